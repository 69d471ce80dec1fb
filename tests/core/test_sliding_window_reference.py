"""Every gradient method (registered with ``reads_gradients``: OAR-G with its noise draws, fisher, path) against the
float64 per-position reference (devtools.reference) on tiny Gemma 3 models whose rows are longer than the sliding
window: padded (left-padded prompts, right-padded responses, all of different lengths) and batched (four rows in one
pass), through run_attribution on a module backend. And the window's geometry (issue 36; docs/performance.md, "Which
attribution on long rows"): where every layer slides, a reasoning token further than the receptive field, layers ×
(window − 1), from every probe position scores exactly 0 and every one within it does not; a full-attention layer
reaches every token. A row scores the same alone, unpadded, as in the padded batch. The models are float64 throughout:
transformers' Gemma 3 norms compute in float32 whatever the model's dtype (:class:`Float64RMSNorm`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from devtools import reference
from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.checks.registries import METHODS
from oar_verl.core.methods.gradient import draw_seeds, sequence_seeds
from oar_helpers import tiny_sliding_window_lm

LT_LOGITS, AS_MEAN, AS_JOINT = ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT
MASK_TOKEN = 100  # fisher's swap target: a token no row holds (make_batch draws ids below 97), so no δ_t is 0
NOISE = 1e-3
SKETCH_SEED = 5
B = 4
SEEDS = sequence_seeds(7, 3, torch.arange(B))
TOLERANCE = dict(rtol=1e-6, atol=0.0)  # the scores are float32 (<= 2e-7 off measured); no absolute slack: a 0 is 0

# name -> (window, layer types or None for Gemma's own rule, more config); every layer sliding, or a full one too
MODELS = {
    "one-sliding-layer": (6, ("sliding_attention",), {}),
    "two-sliding-layers": (4, ("sliding_attention",) * 2, {}),
    "sliding-sliding-full": (5, None, {"num_hidden_layers": 3, "sliding_window_pattern": 3}),
}


@dataclass(frozen=True)
class Case:
    """A configuration of a gradient method and its reference.

    Attributes:
        options: OARConfig keys beside ``mode``.
        kind: every row's probe.
        reference: (model, rows, kind, seeds (B,)) -> (B, T) float64 response-aligned reference scores, signed where
            the method clamps.
        clamped: the method's importance is max(score, 0) (path): a 0 within the window is a negative score there.
    """

    options: dict
    kind: ProbeKind
    reference: Callable[..., torch.Tensor]
    clamped: bool = False

    def importance(self, ref: torch.Tensor) -> torch.Tensor:
        """The importance the method hands to gating from the reference's scores."""
        return ref.clamp(min=0.0) if self.clamped else ref


def oar_g_reference(samples: int) -> Callable[..., torch.Tensor]:
    """OAR-G's reference with K draws: the mean over k of the single-draw reference with draw k's seeds."""

    def run(model, rows, kind, seeds):
        per_draw = draw_seeds(seeds, samples)
        return torch.stack([reference.batch_oar_g(model, *rows, kind, NOISE, per_draw[:, k])
                            for k in range(samples)]).mean(0)

    return run


def fisher_reference(mask: int | str, outcomes: int, sketches: int = 0) -> Callable[..., torch.Tensor]:
    def run(model, rows, kind, seeds):
        return reference.batch_fisher(model, *rows, kind, mask, outcomes, sketches, seed=SKETCH_SEED)

    return run


def path_reference(mask: int | str, points: int) -> Callable[..., torch.Tensor]:
    def run(model, rows, kind, seeds):
        return reference.batch_path(model, *rows, kind, mask, points)

    return run


def conservative_reference(model, rows, kind, seeds):
    """The rules on the model's own modules, one unpadded sequence at a time (the rules themselves: the conservation
    and hand-written Qwen2 checks of tests/core/test_conservative.py)."""
    return reference.batch_conservative(model, *rows, kind, on_module=True)


# every mode registered with reads_gradients=True needs its cases here (test_every_gradient_method_has_a_reference)
REFERENCES: dict[str, dict[str, Case]] = {
    "gradient": {
        "lt_logits": Case({"noise_std": NOISE}, LT_LOGITS, oar_g_reference(1)),
        "as_mean": Case({"noise_std": NOISE}, AS_MEAN, oar_g_reference(1)),
        "as_joint": Case({"noise_std": NOISE}, AS_JOINT, oar_g_reference(1)),
        "2-draws-as_mean": Case({"noise_std": NOISE, "noise_samples": 2}, AS_MEAN, oar_g_reference(2)),
    },
    "fisher": {
        "token-lt_logits": Case({"fisher_outcomes": 3, "mask": "token", "mask_token_id": MASK_TOKEN}, LT_LOGITS,
                                fisher_reference(MASK_TOKEN, 3)),
        "mean-as_mean": Case({"fisher_outcomes": 2, "mask": "mean"}, AS_MEAN, fisher_reference("mean", 2)),
        "token-as_joint": Case({"fisher_outcomes": 3, "mask": "token", "mask_token_id": MASK_TOKEN}, AS_JOINT,
                               fisher_reference(MASK_TOKEN, 3)),
        "sketched-lt_logits": Case({"fisher_outcomes": 1, "fisher_sketches": 2, "seed": SKETCH_SEED, "mask": "token",
                                    "mask_token_id": MASK_TOKEN}, LT_LOGITS, fisher_reference(MASK_TOKEN, 1, 2)),
    },
    "conservative": {
        "lt_logits": Case({}, LT_LOGITS, conservative_reference),
        "as_mean": Case({}, AS_MEAN, conservative_reference),
        "as_joint": Case({}, AS_JOINT, conservative_reference),
    },
    "path": {
        "token-lt_logits": Case({"path_points": 2, "mask": "token", "mask_token_id": MASK_TOKEN}, LT_LOGITS,
                                path_reference(MASK_TOKEN, 2), clamped=True),
        "mean-as_mean": Case({"path_points": 3, "mask": "mean"}, AS_MEAN, path_reference("mean", 3), clamped=True),
        "token-as_joint": Case({"path_points": 2, "mask": "token", "mask_token_id": MASK_TOKEN}, AS_JOINT,
                               path_reference(MASK_TOKEN, 2), clamped=True),
    },
}

GRADIENT_MODES = [name for name in METHODS.names() if METHODS.get(name).reads_gradients]
CASES = [pytest.param(mode, label, id=f"{mode}-{label}")
         for mode in GRADIENT_MODES for label in REFERENCES.get(mode, {"missing": None})]


def case_of(mode: str, label: str) -> Case:
    """The case ``label`` of ``mode``; a failure naming the mode where a gradient method has none."""
    if mode not in REFERENCES:
        pytest.fail(f"algorithm.oar.mode={mode} reads gradients but has no float64 reference case in REFERENCES")
    return REFERENCES[mode][label]


class Float64RMSNorm(Gemma3RMSNorm):
    """Gemma 3's RMSNorm in the input's dtype: transformers' computes in float32 whatever the model's dtype, so a
    "float64" Gemma 3 is float32-exact in its norms, and a gradient of a sum of losses (fisher's sketches) then
    differs from the sum of their gradients (the reference's Jacobian rows) by up to 3.4e-6 relative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * (1.0 + self.weight.to(x.dtype))


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every Gemma3RMSNorm computing in its input's dtype (:class:`Float64RMSNorm`)."""
    norms = [m for m in model.modules() if isinstance(m, Gemma3RMSNorm)]
    assert norms
    for m in norms:
        m.__class__ = Float64RMSNorm
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module: passes over 4 × 24 tokens of a 32-wide model are too small to share, and
    on a busy 2-core machine a second thread only spins (the file ran 5× slower in CPU time with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(MODELS))
def sliding_lm(request):
    """(name, model) of each of :data:`MODELS`, float64 throughout (:func:`float64_norms`), its layers checked to be
    what the name says."""
    window, layer_types, config = MODELS[request.param]
    model = float64_norms(tiny_sliding_window_lm(window, layer_types, **config))
    want = list(layer_types or ("sliding_attention", "sliding_attention", "full_attention"))
    assert model.config.layer_types == want and model.config.sliding_window == window
    return request.param, model


def receptive_field(model) -> int | None:
    """How far back a position's output reads: layers × (window − 1) where every layer slides (a query attends to
    the ``window`` positions up to itself); None (everything) with a full-attention layer."""
    types = model.config.layer_types
    if any(t != "sliding_attention" for t in types):
        return None
    return len(types) * (model.config.sliding_window - 1)


@pytest.fixture(scope="module")
def rows(make_batch):
    """Four verl-layout rows, every one with an answer span, longer than every model's window and with reasoning
    tokens beyond every all-sliding model's receptive field; prompts and responses of different lengths."""
    rows = make_batch(B=B, P=6, T=18, seed=6)
    prompt_mask, response_mask, reasoning, answer = rows[1], rows[3], rows[4], rows[5]
    lengths = prompt_mask.sum(-1) + response_mask.sum(-1)
    assert bool(answer.any(-1).all()) and bool((lengths > max(w for w, _, _ in MODELS.values())).all())
    assert len(set(response_mask.sum(-1).tolist())) == B and len(set(prompt_mask.sum(-1).tolist())) > 1
    assert bool((prompt_mask[:, 0] == 0).any()) and bool((response_mask[:, -1] == 0).any())  # padded both sides
    return rows


@pytest.fixture(scope="module")
def attributed():
    """Memoised (model name, mode, label) -> ((B, T) response-aligned scores of the batch, passes run)."""
    cache: dict[tuple, tuple[torch.Tensor, int]] = {}

    def get(name, model, rows, mode, label):
        if (name, mode, label) not in cache:
            cache[name, mode, label] = attribute(model, rows, mode, case_of(mode, label), SEEDS)
        return cache[name, mode, label]

    return get


@pytest.fixture(scope="module")
def referenced():
    """Memoised (model name, mode, label) -> the case's (B, T) float64 reference scores (signed where clamped)."""
    cache: dict[tuple, torch.Tensor] = {}

    def get(name, model, rows, mode, label):
        if (name, mode, label) not in cache:
            case = case_of(mode, label)
            cache[name, mode, label] = case.reference(model, rows, case.kind, SEEDS)
        return cache[name, mode, label]

    return get


def attribute(model, rows, mode: str, case: Case, seeds: torch.Tensor) -> tuple[torch.Tensor, int]:
    """((b, T) response-aligned scores, passes) of ``rows`` with ``mode`` through run_attribution on the module's
    backend (the worker's settings: checkpointed layers), every row in one pass."""
    cfg = OARConfig(mode=mode, **case.options)
    batch = build_attribution_batch(*rows, torch.full((rows[0].shape[0],), int(case.kind)))
    result = run_attribution(module_backend(model, cfg, limits=PassLimits(10**6)), batch, cfg,
                             mask_token_id=MASK_TOKEN, seeds=seeds)
    return result.importance[:, batch.response_start:], result.passes


def test_every_gradient_method_has_a_reference():
    assert GRADIENT_MODES, "no registered method reads gradients"
    assert set(GRADIENT_MODES) == set(REFERENCES), (
        f"modes registered with reads_gradients=True: {GRADIENT_MODES}; with a float64 reference case here: "
        f"{sorted(REFERENCES)}")


@pytest.mark.parametrize("mode,label", CASES)
def test_gradient_methods_match_the_float64_reference_past_the_window(sliding_lm, rows, attributed, referenced, mode,
                                                                     label):
    name, model = sliding_lm
    case = case_of(mode, label)
    got, passes = attributed(name, model, rows, mode, label)
    signed = referenced(name, model, rows, mode, label)
    ref = case.importance(signed)
    reasoning = rows[4]
    assert passes == 1  # the four padded rows (K draw rows each) in one pass
    torch.testing.assert_close(got.double(), ref, **TOLERANCE)
    assert bool((got[~reasoning] == 0).all()) and bool((signed[reasoning] != 0).sum() > 8)
    assert bool((ref[reasoning] != 0).sum() > 2)


@pytest.mark.parametrize("mode,label", CASES)
def test_the_window_bounds_what_a_probe_can_credit(sliding_lm, rows, attributed, referenced, mode, label):
    """Exactly 0 beyond the receptive field of the probe positions (every one after the reasoning, the first at the
    first answer token − 1), non-zero within it; with a full-attention layer every reasoning token non-zero. A method
    that clamps (path): its signed reference non-zero within, its importance non-zero exactly where that is > 0."""
    name, model = sliding_lm
    case = case_of(mode, label)
    got, _ = attributed(name, model, rows, mode, label)
    if case.clamped:
        signed = referenced(name, model, rows, mode, label)
        assert bool(((got != 0) == (signed > 0)).all())
        got = signed  # what the window bounds: the score before the clamp
    reasoning, answer = rows[4], rows[5]
    reach = receptive_field(model)
    if reach is None:
        assert bool((got[reasoning] != 0).all())
        return
    first_probe = answer.int().argmax(-1) - 1  # (B,) response column predicting the first answer token
    distance = first_probe[:, None] - torch.arange(answer.shape[1])[None, :]  # (B, T)
    beyond = reasoning & (distance > reach)
    assert bool(beyond.any(-1).all())  # every row has reasoning the probe cannot reach
    assert bool((got[beyond] == 0).all()), got * beyond
    assert bool((got[reasoning & ~beyond] != 0).all()), got * (reasoning & ~beyond)


@pytest.mark.parametrize("mode,label", CASES)
def test_a_row_scores_the_same_alone_and_unpadded_as_in_the_batch(sliding_lm, rows, attributed, mode, label):
    name, model = sliding_lm
    batched, _ = attributed(name, model, rows, mode, label)
    prompts, prompt_mask, responses, response_mask, reasoning, answer = rows
    for b in range(B):
        p, r = int(prompt_mask[b].sum()), int(response_mask[b].sum())
        alone_rows = (prompts[b: b + 1, -p:], prompt_mask[b: b + 1, -p:], responses[b: b + 1, :r],
                      response_mask[b: b + 1, :r], reasoning[b: b + 1, :r], answer[b: b + 1, :r])
        alone, _ = attribute(model, alone_rows, mode, case_of(mode, label), SEEDS[b: b + 1])
        torch.testing.assert_close(alone[0], batched[b, :r], **TOLERANCE)
        assert bool((batched[b, r:] == 0).all())
