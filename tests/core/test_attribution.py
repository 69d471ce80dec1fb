"""OAR-P and OAR-G fast paths against the per-sequence, per-position reference of devtools.reference."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig
from oar_verl.core.methods.attribution import response_importance
from devtools import reference
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_helpers import run_p, run_g, count_p, count_g, tiny_sliding_window_lm

LT_LOGITS, AS_MEAN, AS_JOINT = ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT

MASK = 0


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_oar_p_matches_naive(lm64, make_batch, kind, chunk):
    rows = make_batch(B=4, P=5, T=9, seed=kind * 10 + chunk)
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = run_p(lm64, batch, MASK, PassLimits(10**6, rows=3, copies=chunk),
                            prefix_cache=False)[:, batch.response_start:]
    ref = reference.batch_oar_p(lm64, *rows, kind, MASK)
    assert (fast[~rows[4]] == 0).all()
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0  # the comparison is not vacuous


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_oar_p_prefix_cache_matches_naive(lm64, make_batch, kind, chunk):
    rows = make_batch(B=4, P=5, T=9, seed=kind * 10 + chunk + 1)
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = run_p(lm64, batch, MASK, PassLimits(10**6, copies=chunk), prefix_cache=True)
    fast = fast[:, batch.response_start:]
    ref = reference.batch_oar_p(lm64, *rows, kind, MASK)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("span", [2, 3])
def test_oar_p_mask_span_matches_naive(lm64, make_batch, prefix_cache, span):
    rows = make_batch(B=4, P=4, T=10, seed=span)
    batch = build_attribution_batch(*rows, torch.full((4,), AS_MEAN))
    fast = run_p(lm64, batch, MASK, PassLimits(10**6, copies=3), prefix_cache=prefix_cache, mask_span=span)
    ref = reference.batch_oar_p(lm64, *rows, AS_MEAN, MASK, span)
    torch.testing.assert_close(fast[:, batch.response_start:].double(), ref,
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_collective_rounds_counts_every_forward(lm64, make_batch, prefix_cache):
    rows = make_batch(B=3, P=3, T=7, seed=9)
    batch = build_attribution_batch(*rows, torch.full((3,), LT_LOGITS))
    calls = []
    h = lm64.register_forward_hook(lambda *a: calls.append(1))
    try:
        for span in (1, 2):
            calls.clear()
            limits = PassLimits(10**6, rows=2, copies=2)
            run_p(lm64, batch, MASK, limits, prefix_cache=prefix_cache, mask_span=span)
            assert len(calls) == count_p(batch, limits, prefix_cache, span)
    finally:
        h.remove()


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("micro", [1, 3])
def test_oar_g_matches_naive(lm64, make_batch, kind, micro):
    rows = make_batch(B=4, P=5, T=9, seed=100 + kind)
    seeds = sequence_seeds(7, 3, torch.arange(4))
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6, rows=micro))[:, batch.response_start:]
    ref = reference.batch_oar_g(lm64, *rows, kind, 1e-3, seeds)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-12)
    assert ref.abs().sum() > 0


def test_oar_g_leaves_no_parameter_gradient_and_keeps_flags(make_lm, make_batch):
    model = make_lm(torch.float32, seed=1)
    model.lm_head.weight.requires_grad_(True)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rows = make_batch(B=3, P=4, T=6, seed=3)
    batch = build_attribution_batch(*rows, torch.full((3,), AS_MEAN))
    run_g(model, batch, 1e-3, torch.arange(3), PassLimits(10**6, rows=2))
    assert all(p.grad is None for p in model.parameters())
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_oar_g_seeded_noise_is_reproducible_and_batch_independent(lm64, make_batch):
    rows = make_batch(B=5, P=4, T=8, seed=11)
    seeds = sequence_seeds(0, 5, torch.arange(5) * 13)
    batch = build_attribution_batch(*rows, torch.full((5,), LT_LOGITS))
    a = run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6, rows=5))
    b = run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6, rows=2))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-14)
    # a row attributed alone gets the same scores as inside the batch
    one = [r[2:3] for r in rows]
    alone = run_g(lm64, build_attribution_batch(*one, torch.full((1,), LT_LOGITS)), 1e-3, seeds[2:3],
                             PassLimits(10**6))
    torch.testing.assert_close(alone[:, batch.response_start:], a[2:3, batch.response_start:], rtol=1e-6, atol=1e-14)
    c = run_g(lm64, batch, 1e-3, seeds + 1, PassLimits(10**6, rows=5))
    assert not torch.allclose(a, c, rtol=1e-2, atol=0.0)  # other seeds, other noise


def test_oar_p_batch_composition_invariance(lm64, make_batch):
    rows = make_batch(B=5, P=6, T=8, seed=21)
    kinds = torch.full((5,), AS_MEAN)
    full = run_p(lm64, build_attribution_batch(*rows, kinds), MASK, PassLimits(10**6, copies=5))
    for b in range(5):
        one = [r[b: b + 1] for r in rows]
        alone = run_p(lm64, build_attribution_batch(*one, kinds[:1]), MASK, PassLimits(10**6, copies=3))
        torch.testing.assert_close(alone, full[b: b + 1], rtol=1e-6, atol=1e-12)


def test_float32_model_close_to_float64(lm32, lm64, make_batch):
    rows = make_batch(B=3, P=4, T=8, seed=5)
    cfg = OARConfig(mode="perturbation", chunk_size=4, probe="as_mean")
    a = response_importance(lm32, *rows, cfg, mask_token_id=MASK)
    b = response_importance(lm64, *rows, cfg, mask_token_id=MASK)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_response_without_reasoning_or_span(lm64):
    """Empty and one-token responses, a row with no answer span: no crash, zero importance where nothing to score."""
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [3, 4, 5]])
    prompt_mask = (prompts != 0).long()
    responses = torch.tensor([[0, 0, 0], [11, 0, 0], [12, 13, 14]])
    response_mask = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 1]])
    reasoning = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0]]).bool()
    answer = torch.zeros(3, 3, dtype=torch.bool)
    for mode in ("perturbation", "gradient"):
        cfg = OARConfig(mode=mode, probe="as_mean")
        imp = response_importance(lm64, prompts, prompt_mask, responses, response_mask, reasoning, answer, cfg,
                                  mask_token_id=MASK, seeds=torch.arange(3))
        assert imp.shape == (3, 3)
        assert torch.isfinite(imp).all()
        assert (imp[0] == 0).all() and (imp[:, 2] == 0).all()
        assert (imp[2, :2] != 0).any()


def test_nan_logits_propagate_to_a_defined_fallback(make_lm, make_batch):
    """NaN weights give NaN importance, which the gating turns into uniform weights (tested in test_gating)."""
    model = make_lm(torch.float32, seed=2)
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")  # tied: poisons embedding row 3 and logit 3
    rows = make_batch(B=2, P=3, T=5, seed=1)
    cfg = OARConfig(mode="perturbation", probe="lt_logits")
    imp = response_importance(model, *rows, cfg, mask_token_id=MASK)
    assert not torch.isfinite(imp[rows[4]]).all()


def test_min_rounds_runs_extra_rounds(lm64, make_batch):
    rows = make_batch(B=2, P=3, T=4, seed=2)
    batch = build_attribution_batch(*rows, torch.full((2,), LT_LOGITS))
    calls = []
    h = lm64.register_forward_hook(lambda *a: calls.append(1))
    try:
        limits = PassLimits(10**6, rows=8, copies=3)
        n = count_p(batch, limits, prefix_cache=False)
        run_p(lm64, batch, MASK, limits, prefix_cache=False)
        assert len(calls) == n
        calls.clear()
        run_p(lm64, batch, MASK, limits, align_to=n + 4, prefix_cache=False)
        assert len(calls) == n + 4
        calls.clear()
        assert count_g(batch, PassLimits(10**6, rows=1)) == 2
        run_g(lm64, batch, 1e-3, torch.arange(2), PassLimits(10**6, rows=1), align_to=5)
        assert len(calls) == 10  # clean + noisy forward per round
    finally:
        h.remove()


def test_missing_mask_token_and_seeds_are_clear_errors(lm64, make_batch):
    rows = make_batch(B=2, P=3, T=4, seed=4)
    with pytest.raises(ValueError, match="OAR-P needs a mask token: set algorithm.oar.mask=token and "
                                         "algorithm.oar.mask_token_id"):
        response_importance(lm64, *rows, OARConfig(mode="perturbation", mask="pad"), mask_token_id=None)
    with pytest.raises(ValueError, match="OAR-G needs per-sequence noise seeds"):
        response_importance(lm64, *rows, OARConfig(mode="gradient"), seeds=None)


def test_reference_oar_p_batching_and_parameter_backward_give_the_same_scores(lm64, make_batch):
    """The naive baseline's structure (all copies in one forward, the official J.backward() through the parameters)
    computes the same numbers as the one-copy-per-forward reference."""
    rows = make_batch(B=3, P=4, T=8, seed=31)
    one = reference.batch_oar_p(lm64, *rows, AS_MEAN, MASK)
    torch.testing.assert_close(reference.batch_oar_p(lm64, *rows, AS_MEAN, MASK, copies_per_forward=None), one,
                               rtol=1e-9, atol=1e-12)
    seeds = torch.arange(3) + 5
    g = reference.batch_oar_g(lm64, *rows, AS_MEAN, 1e-3, seeds)
    torch.testing.assert_close(reference.batch_oar_g(lm64, *rows, AS_MEAN, 1e-3, seeds, parameter_gradients=True), g,
                               rtol=1e-9, atol=1e-15)
    assert all(p.grad is None for p in lm64.parameters())


def test_reference_token_weights_match_the_gate():
    from oar_verl.core.reshaping.gating import oar_token_weights

    g = torch.Generator().manual_seed(3)
    imp = torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(4, 9, dtype=torch.bool)
    fast = oar_token_weights(imp, mask, mask.long(), tau=0.4, beta=2.0, floor=0.1).weights
    for b in range(4):
        torch.testing.assert_close(fast[b].double(), reference.token_weights(imp[b], 0.4, 2.0, 0.1), rtol=1e-6,
                                   atol=1e-6)


def test_core_entry_points_default_to_the_workers_safe_settings(lm64, make_batch):
    """response_importance (core-only use, e.g. from TRL) checkpoints OAR-G's student pass and packs by a token budget
    by default, as the verl worker does: each decoder layer's MLP runs a third time (the recomputation in the
    backward), and the scores equal those without checkpointing."""
    rows = make_batch(B=3, P=4, T=10, seed=2)
    seeds = sequence_seeds(0, 0, torch.arange(3))
    cfg = OARConfig(mode="gradient", probe="as_mean")
    mlp = lm64.model.layers[0].mlp
    forward, calls = mlp.forward, []

    def counted(*args, **kwargs):  # module hooks do not fire in a checkpoint's recomputation; forward itself does
        calls.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    mlp.forward = counted
    try:
        safe = response_importance(lm64, *rows, cfg, seeds=seeds)
        assert calls == [False, True, True]  # teacher, student, the student's recomputation in the backward
    finally:
        del mlp.forward
    from oar_verl.core.methods.attribution import DEFAULT_MAX_TOKENS, pass_limits

    assert pass_limits(cfg).tokens == DEFAULT_MAX_TOKENS  # a token budget, not a row count
    kinds = torch.full((3,), int(ProbeKind.AS_MEAN))
    batch = build_attribution_batch(*rows, kinds)
    plain = run_g(lm64, batch, cfg.noise_std, seeds, PassLimits(10**6), checkpointing=False)
    torch.testing.assert_close(safe, plain[:, batch.response_start:], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 5])
def test_oar_p_prefix_cache_on_sliding_window_layers_past_the_window(make_batch, chunk):
    # rows longer than the window: the clean pass's cache must keep every position (a sliding-window cache drops the
    # oldest and cannot be cropped back to a masked copy's prefix; transformers raises deep in the forward)
    model = tiny_sliding_window_lm(window=4)
    rows = make_batch(B=3, P=5, T=14, seed=chunk)
    batch = build_attribution_batch(*rows, torch.full((3,), AS_MEAN))
    fast = run_p(model, batch, MASK, PassLimits(10**6, copies=chunk), prefix_cache=True)[:, batch.response_start:]
    ref = reference.batch_oar_p(model, *rows, AS_MEAN, MASK)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0 and int(batch.attention_mask.sum(-1).max()) > 4  # rows past the window
