"""Why do OAR-G and fisher put their mass at the sliding window's edge on Gemma 3 past its window? (issue #36 item 3)

On Gemma 3 270M at 1,024 reasoning tokens the gradient methods put 0.42–0.44 of their mass within ±W/4 tokens of the
window's edge as the answer sees it (reasoning index answer − W, W = 512) and rank like random
(research/docs/faithfulness.md §13–§14). Four experiments per row, on the rows research.long_fidelity cached (the
model's own continuations), ask whether that edge is geometry (the window) or text (what sits there):

(a) **geometry or text?** Delete ``--delete`` (W/4) of the lowest-OAR-G tokens between the edge band and the answer
    (the product's ``delete`` removal: :func:`oar_verl.core.fidelity.operators.deleted_rows`), re-run OAR-G and
    fisher on the shorter row: does the mass stay at answer − W (geometry) or move with the text that held it?
(b) **the same weights with the window widened past the row** (every sliding layer's ``sliding_window`` above the
    row's length; a different model: its outcome moves, reported as KL): edge-band mass; and, as experiment ``f``
    (the dearest, run last), the fidelity metric's gain over random, position and entropy on both models
    (research.long_fidelity's ``chunk_result``, operator ``mean``; the window's from its cache where it ran).
(c) **leave-one-out against the linear prediction** in the edge band: the exact logp shift of masking one token
    (the product's ``outcome_shifts``, operator ``mean``) against −⟨∂φ/∂e_t, ē − e_t⟩ (fisher on the AS-Joint probe:
    φ is the fidelity metric's logp measure), for the top OAR-G tokens and random tokens in the band and the top
    tokens in the last W/4; and the exact KL against fisher K = 1's second-order score.
(d) **attention hand-off**: for the top edge tokens of (c), the attention the probe position and the query at the
    token's window boundary (column + W − 1) pay to the token and to its ±4 neighbours, clean and with the token
    masked (eager attention), per layer type.

Every per-row number goes to ``--out``/<model>_<tokens>/row_NNN.json (one experiment at a time: an interrupted run
resumes), the tables and the pooled numbers to summary.json. ``--quick``: a random-init tiny Gemma 3 (sliding,
sliding, full; window 16) on the quickstart's BPE, 2 rows of ≤ 48 reasoning tokens, in seconds.

What it cannot show: a few rows of one model; (b) changes the model (its local layers' RoPE never saw distances past
W in training); (c) and (d) measure single-token masking, not the joint removals the fidelity metric scores.

usage: python -m research.window_mechanism [--model gemma3|tiny] [--rows N] [--tokens T] [--quick] [--workers N/J]
                                          [--experiments a,b,c,d,f] [--delete N] [--group N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import embedding_mean
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.batch.probes import ProbeOutput, probe_forward, probe_from_logits, probe_keep_positions
from oar_verl.core.fidelity import default_min_gap, outcome_shifts
from oar_verl.core.fidelity.operators import deleted_rows
from research import REPO
from research.common import rows_of, spearman, study_dir
from research.long_fidelity import (BASE, Loaded, chunk_path, chunk_result, load, make_rows, method_config, prepared,
                                    summarise)

EXPERIMENTS = ("a", "b", "c", "d", "f")  # the order they run in; f: (b)'s fidelity metric, the dearest, last
COMPARED = ("oar_g", "fisher_k1_mean")  # the gradient methods (research.long_fidelity.METHODS)
RANKED_BY = "oar_g"  # whose scores pick the deleted (a), top (c) and masked (d) tokens
MASK = "mean"  # the shipped mask operator: the exact removals of (c, d) and fisher's δ_t = ē − e_t
TOP_TEXT = 32  # (a): the originally top-scored tokens whose mass share is followed
NEIGHBOURS = 4  # (d): ± this many columns around a masked token
QUICK = {"model": "tiny", "rows": 2, "tokens": 48, "window": 16, "group": 4, "attention": 3}
CACHED = REPO / "outputs" / "long_fidelity"  # research.long_fidelity's rows and chunks (read, never written)
CACHED_METHODS = ("oar_g", "fisher_k1_mean", "path_m2")  # the cached comparison whose chunks hold both COMPARED


# ---------------------------------------------------------------------------------------------------------------------
# The models
# ---------------------------------------------------------------------------------------------------------------------
def tiny_sliding_gemma(tokenizer, window: int, seed: int = 0) -> torch.nn.Module:
    """A random-init float64 Gemma 3 on ``tokenizer``'s vocabulary: hidden 32, layers sliding, sliding, full, a
    sliding window of ``window`` tokens (the quick mode's model; the global RNG is left as found)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, sliding_window=window, max_position_embeddings=4096,
                           layer_types=["sliding_attention"] * 2 + ["full_attention"], num_hidden_layers=3,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Gemma3ForCausalLM(cfg).double().eval()


def load_model(name: str, window: int) -> Loaded:
    """research.long_fidelity's model ``name``; ``tiny``: its tokenizer with :func:`tiny_sliding_gemma`."""
    m = load(name)
    if name == "tiny":
        m = dataclasses.replace(m, name=f"random-init tiny Gemma 3 (sliding, sliding, full; window {window})",
                                model=tiny_sliding_gemma(m.tokenizer, window))
    return m


def window_of(model: torch.nn.Module) -> int:
    """The model's sliding window W (a query attends to the W positions up to itself)."""
    w = getattr(model.config, "sliding_window", None)
    if not w:
        raise ValueError(f"window_mechanism: {type(model).__name__} has no sliding window (config.sliding_window)")
    return int(w)


@contextlib.contextmanager
def widened(model: torch.nn.Module, window: int):
    """The model with every sliding layer's window set to ``window``: the configuration the attention masks are
    built from and each attention module's own ``sliding_window``; restored on exit."""
    configs = {id(c): c for c in [model.config, *(getattr(x, "config", None) for x in model.modules())]
               if c is not None and getattr(c, "sliding_window", None)}
    layers = [x for x in model.modules() if isinstance(getattr(x, "sliding_window", None), int)
              and isinstance(x, torch.nn.Module)]
    old = [c.sliding_window for c in configs.values()], [x.sliding_window for x in layers]
    for c in configs.values():
        c.sliding_window = window
    for x in layers:
        x.sliding_window = window
    try:
        yield model
    finally:
        for c, w in zip(configs.values(), old[0]):
            c.sliding_window = w
        for x, w in zip(layers, old[1]):
            x.sliding_window = w


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module):
    """The model on eager attention (which returns its attention probabilities); the implementation restored."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


# ---------------------------------------------------------------------------------------------------------------------
# A row's geometry and where its score mass lies
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Where a one-row batch's window edge lies, in reasoning indices (k = 0: the first reasoning token).

    Attributes:
        first: the column of reasoning token 0. reasoning: R. answer: the first answer token as a reasoning index
            (R + the conclusion's tokens); a token's distance from the answer is ``answer − k``.
        edge: answer − W, the earliest token the probe position's sliding layers read directly.
        half: the edge band is [edge − half, edge + half).
    """

    first: int
    reasoning: int
    answer: int
    edge: int
    half: int

    def band(self) -> np.ndarray:
        """The edge band's reasoning indices."""
        return np.arange(max(self.edge - self.half, 0), min(self.edge + self.half, self.reasoning))


def geometry(batch: AttributionBatch, window: int, half: int) -> Geometry:
    """The :class:`Geometry` of a one-row batch (contiguous reasoning, a span probe) under window W = ``window``."""
    reasoning = batch.reasoning_mask[0].bool()
    first = int(reasoning.int().argmax())
    answer = int((batch.probe.logit_weight[0] != 0).int().argmax()) + 1 - first  # logit j predicts token j + 1
    return Geometry(first, int(reasoning.sum()), answer, answer - window, half)


def share(scores: np.ndarray, index: np.ndarray) -> float:
    """The share of a row's score mass (R,) on reasoning indices ``index``."""
    return float(scores[index].sum() / scores.sum())


def peak(scores: np.ndarray, half: int) -> int:
    """The centre of the densest 2·half-token window of a row's scores (R,) (moving sums)."""
    width = min(2 * half, len(scores))
    sums = np.concatenate([[0.0], np.cumsum(scores)])
    mass = sums[width:] - sums[:-width]  # (R − width + 1,) mass of [s, s + width)
    return int(mass.argmax()) + width // 2


def location(scores: np.ndarray, g: Geometry) -> dict:
    """Where a row's mass lies: the edge band's share, the last quarter's, and the distances from the answer of the
    densest 2·half window's centre and of the top-scored token."""
    R = g.reasoning
    return {"edge_band": share(scores, g.band()), "last_quarter": share(scores, np.arange(3 * R // 4, R)),
            "peak_distance": g.answer - peak(scores, g.half), "argmax_distance": g.answer - int(scores.argmax())}


def attribute(m: Loaded, batch: AttributionBatch, seeds: torch.Tensor | None, name: str, limits: PassLimits
              ) -> np.ndarray:
    """Method ``name``'s scores (R,) of a one-row batch through the product's ``run_attribution``."""
    cfg = method_config(m, name)
    r = run_attribution(module_backend(m.model, cfg, limits=limits), batch, cfg, mask_token_id=m.mask_id, seeds=seeds)
    return rows_of(r.importance, batch.reasoning_mask.bool())[0]


def columns(g: Geometry, ks: np.ndarray) -> torch.Tensor:
    """The columns of reasoning indices ``ks`` (reasoning is contiguous)."""
    return torch.as_tensor(g.first + ks, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------------------
# (a) geometry or text
# ---------------------------------------------------------------------------------------------------------------------
def deletion_set(scores: np.ndarray, g: Geometry, count: int) -> np.ndarray:
    """The ``count`` lowest-scored reasoning indices between the edge band's end and the answer, sorted (so every
    token before them, the band included, moves exactly ``count`` closer to the answer)."""
    lo = max(g.edge + g.half, 0)
    if g.reasoning - lo < count:
        raise ValueError(f"window_mechanism: --delete {count} but only {g.reasoning - lo} tokens lie between the edge "
                         f"band and the answer")
    return np.sort(lo + np.argsort(scores[lo:], kind="stable")[:count])


def delete_tokens(batch: AttributionBatch, g: Geometry, ks: np.ndarray) -> AttributionBatch:
    """The one-row batch with reasoning indices ``ks`` removed from the sequence (the fidelity metric's ``delete``)."""
    removed = torch.zeros_like(batch.reasoning_mask, dtype=torch.bool)
    removed[0, columns(g, ks)] = True
    return deleted_rows(batch, torch.zeros(1, dtype=torch.long), removed)


def geometry_or_text(m: Loaded, batch: AttributionBatch, seeds, scores: dict, g: Geometry, window: int, count: int,
                     limits: PassLimits) -> dict:
    """(a): delete ``count`` low-OAR-G tokens after the edge band, re-score, and say where the mass went: at the new
    edge (geometry) or on the moved text (the original band's tokens, now ``count`` closer to the answer)."""
    ks = deletion_set(scores[RANKED_BY], g, count)
    short = delete_tokens(batch, g, ks)
    gs = geometry(short, window, g.half)
    kept = np.setdiff1d(np.arange(g.reasoning), ks)
    moved = (lambda k: k - np.searchsorted(ks, k))  # original index -> index in the shorter row (k not deleted)
    band = g.band()
    out = {"deleted": ks.tolist(), "tokens": [int(batch.attention_mask.sum()), int(short.attention_mask.sum())],
           "reasoning": [g.reasoning, gs.reasoning], "answer": [g.answer, gs.answer], "methods": {}}
    for name in COMPARED:
        before = scores[name]
        after = attribute(m, short, seeds, name, limits)
        top = np.setdiff1d(np.argsort(-before, kind="stable")[:TOP_TEXT], ks)
        out["methods"][name] = {
            "before": location(before, g), "after": location(after, gs),
            "after_on_moved_band": share(after, moved(band)),  # the original band's text, wherever it now sits
            "top_share": [share(before, top), share(after, moved(top))],
            "spearman_kept": spearman(before[kept], after), "scores_after": after.tolist()}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# (b) the window widened past the row
# ---------------------------------------------------------------------------------------------------------------------
def probe_outcome(model: torch.nn.Module, batch: AttributionBatch) -> ProbeOutput:
    """The clean probe of every row (the product's ``probe_forward``)."""
    with torch.no_grad():
        return probe_forward(model, batch.probe, **batch.model_inputs())


def kl(p: ProbeOutput, q: ProbeOutput) -> float:
    """KL(p ‖ q) of the first row's probe distributions."""
    return float((p.logp[0].exp() * (p.logp[0] - q.logp[0])).sum())


def outcome_of(p: ProbeOutput, answer: int) -> dict:
    """The probe's top outcome, its probability, and the row's own answer token's probability."""
    top = p.logp[0].argmax()
    return {"top": int(top), "p_top": float(p.logp[0, top].exp()), "p_answer": float(p.logp[0, answer].exp())}


def answer_token(batch: AttributionBatch) -> int:
    """The first answer token of a one-row batch (the target of its first probe position)."""
    j = int((batch.probe.logit_weight[0] != 0).int().argmax())
    return int(batch.probe.target_ids[0, j])


def windowed_chunk(m: Loaded, rows: list[dict], i: int, tokens: int, out: Path, limits: PassLimits) -> dict:
    """research.long_fidelity's chunk of row ``i`` on the model as it is (its cached file when the long-row study
    ran it with both compared methods and operator ``mean``, else computed here and cached in ``out``)."""
    cached = chunk_path(CACHED / f"{m_key(m)}_{tokens}", i, list(CACHED_METHODS), ("mean",))
    if cached.exists():
        return json.loads(cached.read_text())
    own = chunk_path(out, i, list(COMPARED), ("mean",))
    if not own.exists():
        own.write_text(json.dumps(chunk_result(m, rows[i:i + 1], list(COMPARED), operators=("mean",), draws=4,
                                               random_rankings=4, limits=limits, seed=i)))
    return json.loads(own.read_text())


def m_key(m: Loaded) -> str:
    """The model's name in research.long_fidelity's output folders."""
    return "tiny" if m.random_init else ("gemma3" if "Gemma" in m.name else "smollm2")


def widened_window(m: Loaded, batch: AttributionBatch, seeds, g: Geometry, limits: PassLimits) -> dict:
    """(b): the probe's outcome with and without the window, and the widened model's scores and their mass location."""
    answer = answer_token(batch)
    clean = probe_outcome(m.model, batch)
    with widened(m.model, int(batch.input_ids.shape[1]) + 1):
        wide = probe_outcome(m.model, batch)
        scores = {n: attribute(m, batch, seeds, n, limits) for n in COMPARED}
    return {"kl_window_to_wide": kl(clean, wide), "outcome": [outcome_of(clean, answer), outcome_of(wide, answer)],
            "mass": {n: location(scores[n], g) for n in COMPARED}, "scores": {n: s.tolist() for n, s in scores.items()}}


def widened_fidelity(m: Loaded, rows: list[dict], i: int, limits: PassLimits) -> dict:
    """(b), the dear part: research.long_fidelity's chunk of row ``i`` on the widened model (the fidelity metric,
    operator ``mean``, controls random ×4, position, entropy; the methods re-scored, a training step timed)."""
    with widened(m.model, int(prepared(m, rows[i:i + 1]).batch.input_ids.shape[1]) + 1):
        return chunk_result(m, rows[i:i + 1], list(COMPARED), operators=("mean",), draws=4, random_rankings=4,
                            limits=limits, seed=i)


# ---------------------------------------------------------------------------------------------------------------------
# (c) leave-one-out against the linear prediction
# ---------------------------------------------------------------------------------------------------------------------
def linear_prediction(m: Loaded, batch: AttributionBatch, limits: PassLimits) -> np.ndarray:
    """(R,) −⟨∂φ/∂e_t, ē − e_t⟩ of every reasoning token: the first-order prediction of the logp shift φ_clean −
    φ_masked of masking token t alone (φ: AS-Joint, the mean log-probability of the answer tokens, the fidelity
    metric's ``logp`` measure), i.e. fisher's score on the AS-Joint probe (docs/method.md §11)."""
    cfg = OARConfig(**{**BASE, "mode": "fisher", "fisher_outcomes": 1, "mask": MASK, "probe": "as_joint"})
    joint = dataclasses.replace(batch, probe=dataclasses.replace(batch.probe,
                                                                 joint=torch.ones_like(batch.probe.joint)))
    r = run_attribution(module_backend(m.model, cfg, limits=limits), joint, cfg, mask_token_id=m.mask_id)
    return rows_of(r.importance, batch.reasoning_mask.bool())[0]


def probed_tokens(scores: np.ndarray, g: Geometry, group: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The tokens (c) masks, by group: the ``group`` top-scored in the edge band, ``group`` others drawn at random
    from it, and the ``group`` top-scored in the last ``half`` tokens before the answer."""
    band = g.band()
    top = band[np.argsort(-scores[band], kind="stable")[:group]]
    rest = np.setdiff1d(band, top)
    end = np.arange(max(g.reasoning - g.half, 0), g.reasoning)
    return {"band_top": top, "band_random": np.sort(rng.choice(rest, size=min(group, len(rest)), replace=False)),
            "end_top": end[np.argsort(-scores[end], kind="stable")[:group]]}


def agreement(exact: np.ndarray, predicted: np.ndarray) -> dict:
    """How a prediction of single-token shifts matches the exact ones: Spearman, the share with the same sign, the
    median of |exact| / |predicted|, and the mean |exact|."""
    ratio = np.abs(exact) / np.maximum(np.abs(predicted), 1e-30)
    return {"spearman": spearman(exact, predicted), "sign_agreement": float((np.sign(exact) == np.sign(predicted))
                                                                            .mean()),
            "median_ratio": float(np.median(ratio)), "mean_abs_exact": float(np.abs(exact).mean())}


def leave_one_out_vs_linear(m: Loaded, batch: AttributionBatch, scores: dict, g: Geometry, group: int,
                            rng: np.random.Generator, limits: PassLimits) -> dict:
    """(c): per group of :func:`probed_tokens`, each token masked alone (the product's ``outcome_shifts``, operator
    ``mean``: [kl, logp] shifts) against the linear prediction of the logp shift (:func:`linear_prediction`), and the
    exact KL against fisher K = 1's second-order score (``fisher_k1_mean``)."""
    picked = probed_tokens(scores[RANKED_BY], g, group, rng)
    ks = np.concatenate(list(picked.values()))
    removed = torch.zeros(len(ks), batch.input_ids.shape[1], dtype=torch.bool)
    removed[torch.arange(len(ks)), columns(g, ks)] = True
    exact = outcome_shifts(m.model, batch, removed, MASK, src=torch.zeros(len(ks), dtype=torch.long),
                           mask_token_id=m.mask_id, limits=limits).numpy()  # (2, N): kl, logp
    linear = linear_prediction(m, batch, limits)
    out, at = {}, 0
    for name, idx in picked.items():
        e = exact[:, at:at + len(idx)]
        at += len(idx)
        out[name] = {"tokens": idx.tolist(), "distance": (g.answer - idx).tolist(), "exact_kl": e[0].tolist(),
                     "exact_logp": e[1].tolist(), "linear_logp": linear[idx].tolist(),
                     "fisher_k1": scores["fisher_k1_mean"][idx].tolist(), "oar_g": scores["oar_g"][idx].tolist(),
                     "logp_vs_linear": agreement(e[1], linear[idx]),
                     "kl_vs_fisher": agreement(e[0], scores["fisher_k1_mean"][idx])}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# (d) attention hand-off
# ---------------------------------------------------------------------------------------------------------------------
def attention_rows(model: torch.nn.Module, batch: AttributionBatch, embeds: torch.Tensor, queries: torch.Tensor
                   ) -> tuple[torch.Tensor, ProbeOutput]:
    """((layers, heads, Q, L) attention probabilities of query columns ``queries`` (Q,), the probe) of one row run
    from input embeddings ``embeds`` (1, L, H), eager attention."""
    keep = probe_keep_positions(batch.probe)
    with torch.no_grad(), eager_attention(model):
        out = model(inputs_embeds=embeds, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    output_attentions=True, logits_to_keep=keep, use_cache=False)
    att = torch.stack([a[0][:, queries].double() for a in out.attentions])
    probe = probe_from_logits(out.logits, batch.probe.logit_weight[:, keep], batch.probe.target_ids[:, keep],
                              batch.probe.joint)
    return att, probe


def attention_on(att: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(layers,) attention the weighted queries pay to columns ``cols``: Σ_q weight_q Σ_c att[ℓ, h, q, c], averaged
    over heads. att: (layers, heads, Q, L); weight: (Q,) (zeros for absent queries)."""
    return torch.einsum("lhq,q->l", att[..., cols].sum(-1), weight.double()) / att.shape[1]


def attention_handoff(m: Loaded, batch: AttributionBatch, g: Geometry, window: int, tokens: np.ndarray) -> dict:
    """(d): per masked token (its embedding set to ē, the ``mean`` operator) and layer, the attention on the token
    and on its ±NEIGHBOURS neighbours, clean and masked, from the probe position(s) (weighted as the probe reads
    them) and from the query at the token's window boundary (column + W − 1; absent past the row's end)."""
    model, L = m.model, batch.input_ids.shape[1]
    with torch.no_grad():
        clean_embeds = model.get_input_embeddings()(batch.input_ids)
    mean = embedding_mean(model).to(clean_embeds.dtype)
    last = int(batch.attention_mask[0].sum()) - 1
    probe_cols = (batch.probe.logit_weight[0] != 0).nonzero().squeeze(1)
    cols = torch.as_tensor(g.first + tokens, dtype=torch.long)
    boundary = cols + window - 1  # (n,) each token's last query in a sliding layer
    queries = torch.cat([probe_cols, boundary.clamp(max=last)])  # (P + n,) one clean run reads them all
    probe_w = torch.cat([batch.probe.logit_weight[0, probe_cols], torch.zeros(len(tokens))])
    clean_att, clean_probe = attention_rows(model, batch, clean_embeds, queries)
    out = {"layer_types": list(model.config.layer_types), "tokens": []}
    for j, k in enumerate(tokens.tolist()):  # one masked forward per token (a handful per row)
        c = int(cols[j])
        bound_w = torch.zeros(len(queries))
        bound_w[len(probe_cols) + j] = float(boundary[j] <= last)
        near = torch.tensor([x for x in range(c - NEIGHBOURS, c + NEIGHBOURS + 1) if x != c and 0 <= x < L])
        masked_embeds = clean_embeds.clone()
        masked_embeds[0, c] = mean
        masked_att, masked_probe = attention_rows(model, batch, masked_embeds, queries)
        entry = {"token": k, "distance": g.answer - k, "in_probe_reach": bool(k >= g.edge),
                 "boundary_exists": bool(boundary[j] <= last), "kl_eager": kl(clean_probe, masked_probe)}
        for state, att in (("clean", clean_att), ("masked", masked_att)):
            entry[state] = {f"{who}_{what}": attention_on(att, w, at).tolist()
                            for who, w in (("probe", probe_w), ("boundary", bound_w))
                            for what, at in (("self", torch.tensor([c])), ("neighbours", near))}
            entry[state]["row_sum_error"] = float((att.sum(-1) - 1).abs().max())
        out["tokens"].append(entry)
    return out


def handoff_summary(entries: list[dict], layer_types: list[str]) -> dict:
    """Per query kind and layer type, pooled over tokens and layers of that type: mean attention on the token and on
    its neighbours, clean and masked, and ``moved``: Σ(gain on the neighbours) / Σ(loss on the token)."""
    out = {}
    for who in ("probe", "boundary"):
        for kind in sorted(set(layer_types)):
            sel = torch.tensor([t == kind for t in layer_types])
            use = [e for e in entries if who == "probe" or e["boundary_exists"]]
            if not use:
                continue
            get = (lambda state, what: torch.tensor([e[state][f"{who}_{what}"] for e in use])[:, sel])  # (n, layers)
            cs, ms, cn, mn = get("clean", "self"), get("masked", "self"), get("clean", "neighbours"), \
                get("masked", "neighbours")
            lost = float((cs - ms).sum())
            out[f"{who}/{kind}"] = {"tokens": len(use), "self": [float(cs.mean()), float(ms.mean())],
                                    "neighbours": [float(cn.mean()), float(mn.mean())],
                                    "moved": float((mn - cn).sum()) / lost if lost > 0 else float("nan")}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Per row, resumable
# ---------------------------------------------------------------------------------------------------------------------
def original_scores(m: Loaded, rows: list[dict], i: int, tokens: int, batch, seeds, limits) -> tuple[dict, str]:
    """The compared methods' scores (R,) of row ``i`` on the model as it is: research.long_fidelity's cached chunk
    where it has them, else computed."""
    cached = chunk_path(CACHED / f"{m_key(m)}_{tokens}", i, list(CACHED_METHODS), ("mean",))
    if cached.exists():
        chunk = json.loads(cached.read_text())
        return {n: np.asarray(chunk["scores"][n][0]) for n in COMPARED}, str(cached.relative_to(REPO))
    return {n: attribute(m, batch, seeds, n, limits) for n in COMPARED}, "computed"


def run_row(m: Loaded, rows: list[dict], i: int, a, out: Path, limits: PassLimits, log) -> dict:
    """Every requested experiment of row ``i`` not yet in its cache file, saved after each."""
    path = out / f"row_{i:03d}.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    window = window_of(m.model)
    half = window // 4
    prep = prepared(m, rows[i:i + 1])
    batch, seeds = prep.batch, prep.seeds
    g = geometry(batch, window, half)
    if "scores" not in res:
        scores, source = original_scores(m, rows, i, a.tokens, batch, seeds, limits)
        res.update(scores={n: s.tolist() for n, s in scores.items()}, scores_from=source, window=window, half=half,
                   geometry=dataclasses.asdict(g), location={n: location(s, g) for n, s in scores.items()})
        path.write_text(json.dumps(res))
    scores = {n: np.asarray(s) for n, s in res["scores"].items()}
    for exp in a.experiments:
        if exp in res:
            continue
        t0 = time.perf_counter()
        if exp == "a":
            got = geometry_or_text(m, batch, seeds, scores, g, window, a.delete or half, limits)
        elif exp == "b":
            got = widened_window(m, batch, seeds, g, limits)
        elif exp == "f":
            got = {"widened": widened_fidelity(m, rows, i, limits),
                   "window": windowed_chunk(m, rows, i, a.tokens, out, limits)}
        elif exp == "c":
            got = leave_one_out_vs_linear(m, batch, scores, g, a.group, np.random.default_rng(1000 + i), limits)
        else:  # "d"
            top = probed_tokens(scores[RANKED_BY], g, a.group, np.random.default_rng(0))["band_top"][:a.attention]
            got = attention_handoff(m, batch, g, window, top)
        res = json.loads(path.read_text())  # as it is now: processes running other experiments of the row write it too
        res[exp] = got
        res.setdefault("seconds", {})[exp] = time.perf_counter() - t0
        path.write_text(json.dumps(res))
        log(f"  row {i}: ({exp}) {res['seconds'][exp]:.0f} s")
    return res


# ---------------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------------
def _mean(values) -> str:
    v = np.asarray(list(values), dtype=np.float64)
    return f"{np.nanmean(v):.2f}" if v.size else "–"


def _per_row(values, fmt="{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def table_a(res: list[dict]) -> str:
    """(a): where the mass is before and after the deletion, per method (mean; per row)."""
    rows = [r for r in res if "a" in r]
    if not rows:
        return ""
    n = rows[0]["a"]["reasoning"][0] - rows[0]["a"]["reasoning"][1]
    lines = [f"(a) {n} low-OAR-G tokens deleted after the edge band, {len(rows)} rows (mean; per row). Geometry: the "
             f"mass stays at the new edge (peak distance stays W). Text: it stays on the moved band (peak distance "
             f"falls by {n}).", "",
             "| method | edge band before | after: at the new edge | after: on the moved band | peak distance before "
             "→ after | top-token distance before → after | top-32 tokens' share before → after | Spearman (kept) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in COMPARED:
        e = [r["a"]["methods"][name] for r in rows]
        lines.append(
            f"| {name} | {_mean(x['before']['edge_band'] for x in e)} ({_per_row(x['before']['edge_band'] for x in e)})"
            f" | {_mean(x['after']['edge_band'] for x in e)} ({_per_row(x['after']['edge_band'] for x in e)})"
            f" | {_mean(x['after_on_moved_band'] for x in e)} ({_per_row(x['after_on_moved_band'] for x in e)})"
            f" | {_per_row((x['before']['peak_distance'] for x in e), '{}')} → "
            f"{_per_row((x['after']['peak_distance'] for x in e), '{}')}"
            f" | {_per_row((x['before']['argmax_distance'] for x in e), '{}')} → "
            f"{_per_row((x['after']['argmax_distance'] for x in e), '{}')}"
            f" | {_mean(x['top_share'][0] for x in e)} → {_mean(x['top_share'][1] for x in e)}"
            f" | {_mean(x['spearman_kept'] for x in e)} ({_per_row(x['spearman_kept'] for x in e)}) |")
    return "\n".join(lines)


def table_b(res: list[dict], min_gap: float) -> tuple[str, dict]:
    """(b): the outcome's move; per method, edge-band and last-quarter mass with the window and widened past the row;
    and, on the rows where the fidelity part ran, the gains over the controls (research.long_fidelity.summarise)."""
    rows = [r for r in res if "b" in r]
    if not rows:
        return "", {}
    fid = [r["f"] for r in res if "f" in r]
    sums = {k: summarise([f[k] for f in fid], list(COMPARED), min_gap) for k in ("window", "widened")} if fid else {}
    iv = (lambda d: f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]")
    kls = [r["b"]["kl_window_to_wide"] for r in rows]
    changed = sum(r["b"]["outcome"][0]["top"] != r["b"]["outcome"][1]["top"] for r in rows)
    lines = [f"(b) The same weights with every sliding layer's window widened past the row (a different model), "
             f"{len(rows)} rows (gains: {len(fid)} rows). The probe's outcome moves: KL(window ‖ widened) "
             f"{_per_row(kls, '{:.3f}')}; top outcome changed on {changed} of {len(rows)} rows; p(own answer) "
             f"{_per_row((r['b']['outcome'][0]['p_answer'] for r in rows))} → "
             f"{_per_row((r['b']['outcome'][1]['p_answer'] for r in rows))}.", "",
             "| model | method | edge-band mass (per row) | last-quarter mass | gain over random | over position | "
             "over entropy |",
             "|---|---|---|---|---|---|---|"]
    for key in ("window", "widened"):
        for name in COMPARED:
            mass = [r["location"][name] if key == "window" else r["b"]["mass"][name] for r in rows]
            g = sums[key]["methods"][name]["gain_over"] if sums else None
            gains = f"{iv(g['random'])} | {iv(g['position'])} | {iv(g['entropy'])}" if g else "– | – | –"
            lines.append(f"| {key} | {name} | {_mean(x['edge_band'] for x in mass)} "
                         f"({_per_row(x['edge_band'] for x in mass)}) | {_mean(x['last_quarter'] for x in mass)} | "
                         f"{gains} |")
        for c, e in (sums[key]["controls"].items() if sums else ()):
            lines.append(f"| {key} | {c} (control) | – | – | {iv(e['gain_over']['random'])} | – | – |")
    return "\n".join(lines), sums


def table_c(res: list[dict]) -> tuple[str, dict]:
    """(c): per group, pooled over rows: the exact logp shift against its linear prediction, and the exact KL
    against fisher K = 1's score (Spearman: the mean of the rows'; sign and ratio: pooled tokens)."""
    rows = [r for r in res if "c" in r]
    if not rows:
        return "", {}
    pooled = {}
    lines = [f"(c) Each token masked alone (operator mean) against the first-order prediction, {len(rows)} rows.", "",
             "| group | tokens | mean |exact logp shift| | Spearman (exact, linear) | same sign | median "
             "|exact| / |linear| | mean exact KL | Spearman (exact KL, fisher K=1) | median KL / fisher |",
             "|---|---|---|---|---|---|---|---|---|"]
    for group in rows[0]["c"]:
        e = [r["c"][group] for r in rows]
        cat = (lambda key: np.concatenate([np.asarray(x[key]) for x in e]))
        whole, kl_whole = agreement(cat("exact_logp"), cat("linear_logp")), agreement(cat("exact_kl"), cat("fisher_k1"))
        per_row = [x["logp_vs_linear"]["spearman"] for x in e]
        per_row_kl = [x["kl_vs_fisher"]["spearman"] for x in e]
        pooled[group] = {"logp_vs_linear": whole, "kl_vs_fisher": kl_whole, "spearman_rows": per_row,
                         "spearman_kl_rows": per_row_kl}
        lines.append(f"| {group} | {len(cat('exact_logp'))} | {whole['mean_abs_exact']:.2g} | {_mean(per_row)} "
                     f"({_per_row(per_row)}) | {whole['sign_agreement']:.2f} | {whole['median_ratio']:.2f} | "
                     f"{kl_whole['mean_abs_exact']:.2g} | {_mean(per_row_kl)} | {kl_whole['median_ratio']:.2f} |")
    return "\n".join(lines), pooled


def table_d(res: list[dict]) -> tuple[str, dict]:
    """(d): attention on the masked token and its neighbours, clean → masked, per query kind and layer type."""
    rows = [r for r in res if "d" in r]
    if not rows:
        return "", {}
    entries = [t for r in rows for t in r["d"]["tokens"]]
    summary = handoff_summary(entries, rows[0]["d"]["layer_types"])
    reach = sum(t["in_probe_reach"] for t in entries)
    lines = [f"(d) Top edge tokens masked (ē), {len(entries)} tokens in {len(rows)} rows ({reach} within the probe's "
             f"sliding reach); attention summed over the probe's positions as it reads them, or from the query at "
             f"column + W − 1; mean over heads, tokens and the layers of a type.", "",
             "| queries | layers | tokens | on the token: clean → masked | on its ±4 neighbours: clean → masked | "
             "share of the lost attention the neighbours gain |", "|---|---|---|---|---|---|"]
    for key, s in summary.items():
        who, kind = key.split("/")
        lines.append(f"| {who} | {kind} | {s['tokens']} | {s['self'][0]:.4f} → {s['self'][1]:.4f} | "
                     f"{s['neighbours'][0]:.4f} → {s['neighbours'][1]:.4f} | {s['moved']:.2f} |")
    return "\n".join(lines), summary


# ---------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3", choices=("gemma3", "tiny"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="the rows' reasoning cap (research.long_fidelity's)")
    ap.add_argument("--quick", action="store_true", help="the tiny random-init Gemma 3, 2 short rows: seconds")
    ap.add_argument("--experiments", default="a,b,c,d,f")
    ap.add_argument("--delete", type=int, default=0, help="(a) tokens deleted (default W/4)")
    ap.add_argument("--group", type=int, default=12, help="(c) tokens per group and row")
    ap.add_argument("--attention", type=int, default=8, help="(d) top edge tokens masked per row")
    ap.add_argument("--window", type=int, default=16, help="the tiny model's sliding window")
    ap.add_argument("--max-tokens", type=int, default=8192, help="token budget of one pass")
    ap.add_argument("--workers", default="1/0", help="N/J: compute only the rows i with i mod N = J; the others are "
                    "read from their cache files where present")
    ap.add_argument("--out", default=str(REPO / "outputs" / "window_mechanism"))
    a = ap.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    unknown = sorted(set(a.experiments.split(",")) - set(EXPERIMENTS) - {""})
    if unknown:
        raise SystemExit(f"--experiments: unknown {unknown}; allowed: {', '.join(EXPERIMENTS)}")
    a.experiments = [e for e in EXPERIMENTS if e in a.experiments.split(",")]
    out, log = study_dir(a.out, a.model, a.tokens)

    torch.manual_seed(0)
    m = load_model(a.model, a.window)
    rows_file = CACHED / f"{a.model}_{a.tokens}" / "rows.json"
    rows = json.loads(rows_file.read_text())[:a.rows] if a.model != "tiny" and rows_file.exists() else []
    if len(rows) < a.rows:
        rows = make_rows(m, a.rows, a.tokens, out / "rows.json", log)
    limits = PassLimits(a.max_tokens)
    n_workers, worker = (int(x) for x in a.workers.split("/"))
    res = []
    for exp in a.experiments:  # every row's (a), then every row's (c), ...: the dearest last
        for i in range(len(rows)):
            if i % n_workers == worker:
                a_one = argparse.Namespace(**{**vars(a), "experiments": [exp]})
                run_row(m, rows, i, a_one, out, limits, log)
    for i in range(len(rows)):
        path = out / f"row_{i:03d}.json"
        if path.exists():
            res.append(json.loads(path.read_text()))
    if not res:
        log("no row computed yet")
        return 0
    text_b, sums_b = table_b(res, default_min_gap(m.model))
    text_c, pooled_c = table_c(res)
    text_d, summary_d = table_d(res)
    text = "\n\n".join(t for t in (f"**{m.name}**, window {window_of(m.model)}, edge band ±{res[0]['half']} tokens, "
                                   f"{len(res)} rows", table_a(res), text_b, text_c, text_d) if t)
    (out / "summary.json").write_text(json.dumps({"model": m.name, "rows": [r["geometry"] for r in res],
                                                  "b": sums_b, "c": pooled_c, "d": summary_d}, indent=1))
    (out / "tables.md").write_text(text + "\n")
    log(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
