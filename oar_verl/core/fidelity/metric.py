"""A fidelity metric for token attributions: does a ranking of the reasoning tokens find the tokens the outcome
depends on, whatever "removing a token" means? (docs/fidelity.md)

For each ranking (a method's scores, random rankings, candidate "best" rankings) and each fraction f, the top
⌈f·R⌉ reasoning tokens of a row (R = the row's reasoning tokens) are removed **jointly** with each operator:

* ``mask``: replaced by a given mask token (length unchanged);
* ``zero``: their input embeddings zeroed (a forward hook on ``get_input_embeddings()``);
* ``delete``: dropped from the sequence (the row gets shorter; attention mask, position ids and probe positions
  follow: a probe position that predicted token c reads the position that predicts c in the shorter row);
* ``resample``: replaced by tokens drawn from the model's own next-token distribution at that position given the clean
  prefix (one clean forward gives every position's distribution); the shift is the mean over ``draws`` draws.

and the **outcome shift** of the perturbed row against the clean row is measured twice (the ``measure`` axis, size 2):

* ``kl``: :func:`oar_verl.core.batch.probes.outcome_shift`, KL(P_clean ‖ P_perturbed) of the row's probe (φ_clean − φ
  for AS-Joint rows);
* ``logp``: the drop of log p(answer), φ_clean − φ_perturbed with φ = Σ_k w_k log p(target_k) read from the row's
  own :class:`~oar_verl.core.batch.probes.ProbeSpec` (weights ``logit_weight``, tokens ``target_ids``): on rows whose probe
  reads answer tokens, the mean log-probability of the answer tokens (teacher-forced); on LT-Logits rows, the
  log-probability of the token the probe position predicts (the first answer token when the row has an answer span,
  else the token after the reasoning, e.g. EOS); NaN where that token is padding.

From the deletion curves (``curve``: (2, B, O, F)) come AOPC (mean over f, then over operators), NAOPC against random
and best rankings, suppression safety S and the share of the gated advantage mass on the best ranking's top tokens;
see :func:`fidelity_report`. Everything is vectorised over padded batches and packed under a token budget like the
rest of the core (:func:`oar_verl.core.backends.budget.pack_rows`); the cost per ranking is one forward per operator per f
(``draws`` for ``resample``), independent of R. Shapes use the notation of :mod:`oar_verl.core`, plus G removal sets,
O operators, F fractions, D resampling draws, N perturbed rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from oar_verl.core.backends.budget import PassLimits, pack_rows, row_spans
from oar_verl.core.reshaping.gating import oar_token_weights
from oar_verl.core.batch.hashing import _mix, _uniform
from oar_verl.core.batch.layout import AttributionBatch, position_ids_from_mask
from oar_verl.core.batch.probes import ProbeOutput, logits_at, outcome_shift, probe_from_logits

__all__ = [
    "FRACTIONS", "MEASURES", "OPERATORS", "FidelityReport", "Interval", "MethodFidelity", "aopc", "bootstrap_mean",
    "bottom_removal", "default_min_gap", "fidelity_report", "leave_one_out_scores", "mass_on_target", "naopc",
    "outcome_shifts", "position_scores", "random_scores", "ranks_from_scores", "removal_count", "resample_tokens",
    "row_keys", "suppression_ratio", "top_removal",
]

OPERATORS = ("mask", "zero", "delete", "resample")
MEASURES = ("kl", "logp")
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
DEFAULT_MAX_TOKENS = 16384  # the core's default pass budget (oar_verl.core.methods.attribution.DEFAULT_MAX_TOKENS)
_KIND = "forward"  # oar_verl.core.backends.memory.PassKind.FORWARD, for the memory guard of PassLimits
_STREAM_RANDOM, _STREAM_RESAMPLE = 0x52414E44, 0x52455341  # hash streams: random rankings, resampling draws


def row_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 content key of each row (its real tokens and their order), independent of padding and batching."""
    mask = attention_mask.long()
    pos = mask.cumsum(-1)
    return (mask * _mix(input_ids.long() * 1_000_003 + pos)).sum(-1)


def _reasoning_rank(reasoning: torch.Tensor) -> torch.Tensor:
    """(B, L) long: the index of each reasoning token among its row's reasoning tokens (0-based; junk elsewhere)."""
    return reasoning.long().cumsum(-1) - 1


# ------------------------------------------------------------------------------------------------ rankings
def ranks_from_scores(scores: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """Rank of each reasoning token by score, highest first.

    Args:
        scores: (B, L) float; NaN counts as −inf (ranked last). Ties: the earlier column first.
        reasoning: (B, L) bool.

    Returns:
        (B, L) long: 0..R_b−1 on the reasoning tokens of row b, L elsewhere.
    """
    B, L = scores.shape
    s = torch.nan_to_num(scores.double(), nan=float("-inf"))
    order = torch.sort(-s, dim=-1, stable=True).indices  # descending score, earlier column on ties
    order = order.gather(-1, torch.sort((~reasoning).gather(-1, order).byte(), dim=-1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(L, device=scores.device).expand(B, L))
    return torch.where(reasoning, rank, L)


def random_scores(batch: AttributionBatch, seed: int, index: int) -> torch.Tensor:
    """(B, L) float64 uniform scores on the reasoning tokens (0 elsewhere): random ranking ``index`` of each row, a
    function of (seed, index, the row's content, the token's reasoning rank) only."""
    key = row_keys(batch.input_ids, batch.attention_mask)[:, None].cpu()
    u = _uniform(seed, _STREAM_RANDOM + index, key, _reasoning_rank(batch.reasoning_mask).cpu())
    return torch.where(batch.reasoning_mask.cpu(), u, 0.0).to(batch.input_ids.device)


def position_scores(batch: AttributionBatch) -> torch.Tensor:
    """(B, L) float64 scores that rank each row's reasoning tokens by position alone, the latest first (0 elsewhere): a
    control to pass beside the methods. The outcome is read right after the reasoning, so removing the last tokens
    moves it by itself; a method that does not beat this ranking found nothing position does not already give, and
    suppressing the earliest tokens is a low bar for S (docs/fidelity.md §4)."""
    reasoning = batch.reasoning_mask.bool()
    return torch.where(reasoning, reasoning.double().cumsum(-1), 0.0)


def removal_count(fraction: float, reasoning_tokens: torch.Tensor) -> torch.Tensor:
    """(B,) long ⌈f·R⌉ (at most R; 1e-9 slack so that e.g. 0.1·30 is 3, not 4)."""
    r = reasoning_tokens.double()
    return torch.minimum(torch.ceil(fraction * r - 1e-9).clamp(min=0), r).long()


def top_removal(rank: torch.Tensor, reasoning: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B, L) bool: each row's top ⌈f·R⌉ reasoning tokens of ``rank`` (B, L) (:func:`ranks_from_scores`)."""
    k = removal_count(fraction, reasoning.sum(-1))
    return reasoning & (rank < k[:, None])


def bottom_removal(rank: torch.Tensor, reasoning: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B, L) bool: each row's bottom ⌈f·R⌉ reasoning tokens of ``rank`` (B, L)."""
    r = reasoning.sum(-1)
    k = removal_count(fraction, r)
    return reasoning & (rank >= (r - k)[:, None])


# ------------------------------------------------------------------------------------------------ forward passes
@contextlib.contextmanager
def _preserved(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no gradient inside; every module's train/eval flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            yield
    finally:
        for m, t in flags:
            m.training = t


@contextlib.contextmanager
def _zeroed(model: torch.nn.Module, keep: torch.Tensor | None) -> Iterator[None]:
    """While active, the input-embedding output is multiplied by ``keep`` (n, w) (0 = zero embedding)."""
    if keep is None:
        yield
        return
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, out: out * keep[..., None].to(out.dtype))
    try:
        yield
    finally:
        handle.remove()


def _passes(attention_mask: torch.Tensor, limits: PassLimits) -> list[tuple[torch.Tensor, int, int]]:
    """Passes over the rows of ``attention_mask`` (N, L) packed under the budget: (rows (n,), lo, hi) column windows."""
    start, end = (t.tolist() for t in row_spans(attention_mask.cpu()))  # host metadata, once per call
    out = []
    for rows in pack_rows(attention_mask, limits, _KIND):
        idx = rows.tolist()
        out.append((rows, min(start[i] for i in idx), max(end[i] for i in idx)))
    return out


def _forward(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor,
             target: torch.Tensor, zero_keep: torch.Tensor | None = None,
             extra: torch.Tensor | None = None) -> tuple[ProbeOutput, torch.Tensor | None, torch.Tensor | None]:
    """One forward of n rows (one column window of width w), logits only at the probe positions (and ``extra``).

    Args:
        ids, attn, pos: (n, w) inputs. weight: (n, w) probe weights. target: (n, w) long predicted tokens.
        zero_keep: (n, w) bool, 0 = zero the input embedding there (operator ``zero``).
        extra: (w,) bool, more logit positions to return (resampling).

    Returns:
        (probe (n, V) / (n,) with φ = Σ_k w_k log p(target_k) on every row, extra logits (n, K', V) or None,
        extra positions (K',) or None).
    """
    keep = (weight != 0).any(0)
    if extra is not None:
        keep = keep | extra
    cols = keep.nonzero().squeeze(1)
    with _zeroed(model, zero_keep):
        logits = logits_at(model, cols, input_ids=ids, attention_mask=attn, position_ids=pos)
    w = weight[:, cols]
    probe = probe_from_logits(logits, w, target[:, cols], torch.ones(ids.shape[0], dtype=torch.bool,
                                                                    device=ids.device))
    if extra is None:
        return probe, None, None
    sel = extra[cols]
    return probe, logits[:, sel], cols[sel]


def _targets(ids: torch.Tensor) -> torch.Tensor:
    """(N, L) the token each logit position predicts (ids shifted left, 0 at the end)."""
    t = torch.zeros_like(ids)
    t[:, :-1] = ids[:, 1:]
    return t


@dataclass
class _Clean:
    """The clean read-out of a batch: probe (B, V) / (B,), the valid-logp rows (B,), resampled tokens (B, L, D)."""

    probe: ProbeOutput
    logp_valid: torch.Tensor
    sampled: torch.Tensor | None
    forwards: int


def _sample(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: logits (n, K, V), uniforms (n, K, D) -> (n, K, D) long token ids (chunked over K so that
    the float temporaries stay at ~2^24 elements)."""
    n, K, V = logits.shape
    out = torch.empty(u.shape, dtype=torch.long, device=logits.device)
    step = max(1, (1 << 24) // max(n * V, 1))
    for s in range(0, K, step):  # per chunk of positions, not per token
        p = torch.softmax(logits[:, s:s + step].to(torch.promote_types(logits.dtype, torch.float32)), -1)
        cdf = p.cumsum(-1)
        q = u[:, s:s + step].to(cdf.dtype) * cdf[..., -1:]
        out[:, s:s + step] = torch.searchsorted(cdf, q.contiguous()).clamp(max=V - 1)
    return out


def _clean_pass(model: torch.nn.Module, batch: AttributionBatch, limits: PassLimits, draws: int, seed: int) -> _Clean:
    """Clean probes of every row and, with ``draws`` > 0, D tokens per reasoning position drawn from the model's
    next-token distribution given the clean prefix (uniforms hashed from seed, row content, reasoning rank, draw)."""
    B, L = batch.input_ids.shape
    dev = batch.input_ids.device
    spec = batch.probe
    V = None
    logp = phi = None
    sampled = torch.zeros(B, L, max(draws, 0), dtype=torch.long, device=dev) if draws else None
    keys = row_keys(batch.input_ids, batch.attention_mask).cpu()
    rr = _reasoning_rank(batch.reasoning_mask).cpu()
    # logit position c predicts token c + 1: the positions predicting a reasoning token
    predicts_reasoning = torch.zeros_like(batch.reasoning_mask)
    predicts_reasoning[:, :-1] = batch.reasoning_mask[:, 1:]
    passes = _passes(batch.attention_mask, limits)
    for rows, lo, hi in passes:
        sl = (rows, slice(lo, hi))
        extra = predicts_reasoning[rows, lo:hi].any(0) if draws else None
        probe, z, cols = _forward(model, batch.input_ids[sl], batch.attention_mask[sl], batch.position_ids[sl],
                                  spec.logit_weight[sl], spec.target_ids[sl], extra=extra)
        if logp is None:
            V = probe.logp.shape[-1]
            logp = torch.zeros(B, V, dtype=probe.logp.dtype, device=dev)
            phi = torch.zeros(B, dtype=probe.phi.dtype, device=dev)
        logp[rows], phi[rows] = probe.logp, probe.phi
        if draws and cols.numel():
            nxt = (cols + lo + 1).cpu()  # full-sequence column of the predicted token
            u = _uniform(seed, keys[rows.cpu()][:, None, None], rr[rows.cpu()][:, nxt][..., None],
                         _STREAM_RESAMPLE + torch.arange(draws)[None, None, :])
            tok = _sample(z, u.to(dev))
            nxt = nxt.to(dev)
            on = batch.reasoning_mask[rows[:, None], nxt[None, :]]  # (n, K'): only reasoning tokens get draws
            sampled[rows[:, None], nxt[None, :]] = torch.where(on[..., None], tok, 0)
    if logp is None:  # no non-empty row
        raise ValueError("fidelity: the batch has no non-empty row")
    # the logp measure needs a real target token behind every probe position
    nxt_real = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    nxt_real[:, :-1] = batch.attention_mask[:, 1:].bool()
    valid = ((spec.logit_weight == 0) | nxt_real).all(-1) & (spec.logit_weight != 0).any(-1)
    return _Clean(ProbeOutput(logp, phi), valid, sampled, len(passes))


def resample_tokens(model: torch.nn.Module, batch: AttributionBatch, draws: int = 4, *, seed: int = 0,
                    limits: PassLimits | None = None) -> torch.Tensor:
    """Tokens the ``resample`` operator puts in place of removed reasoning tokens.

    Args:
        model: a Hugging Face causal LM (left as found). batch: AttributionBatch (B, L). draws: D >= 1.
        seed: the draws are a function of (seed, the row's content, the token's reasoning rank, the draw).
        limits: the token budget of one pass (default 16,384 tokens).

    Returns:
        (B, L, D) long: at each reasoning position t, D tokens drawn from p(· | clean prefix y_<t) (inverse CDF of
        the logits at position t − 1); 0 elsewhere. One clean forward per row.
    """
    with _preserved(model):
        return _clean_pass(model, batch, limits or PassLimits(DEFAULT_MAX_TOKENS), draws, seed).sampled


def _delete_rows(batch: AttributionBatch, src: torch.Tensor, removed: torch.Tensor):
    """The rows ``src`` (n,) with ``removed`` (n, L) tokens dropped, left-aligned: (ids, attn, pos, weight, target),
    each (n, L). A probe weight at logit position j (which predicts token j + 1) moves to the position that predicts
    the same token in the shorter row: (kept tokens in columns ≤ j) − 1."""
    keep = batch.attention_mask[src].bool() & ~removed
    n, L = keep.shape
    ck = keep.long().cumsum(-1)
    dest = torch.where(keep, ck - 1, L)  # dropped tokens go to a dump column
    ids = torch.zeros(n, L + 1, dtype=batch.input_ids.dtype, device=keep.device)
    ids.scatter_(1, dest, batch.input_ids[src])
    ids = ids[:, :L]
    attn = (torch.arange(L, device=keep.device)[None, :] < ck[:, -1:]).long()
    w = batch.probe.logit_weight[src]
    weight = torch.zeros_like(w).scatter_add_(1, (ck - 1).clamp(min=0), w)
    return ids, attn, position_ids_from_mask(attn), weight, _targets(ids)


def _shifts(model: torch.nn.Module, batch: AttributionBatch, clean: _Clean, removed: torch.Tensor,
            src: torch.Tensor, operator: str, limits: PassLimits,
            mask_token_id: int | None) -> tuple[torch.Tensor, int]:
    """(2, N) outcome shifts (kl, logp) of the N perturbed rows (``src`` (N,), ``removed`` (N, L)) under one operator
    (``resample``: the mean over the D draws of ``clean.sampled``), and the forwards run."""
    spec = batch.probe
    D = clean.sampled.shape[-1] if operator == "resample" else 1
    req = torch.arange(removed.shape[0], device=removed.device).repeat_interleave(D)  # request -> perturbed row
    draw = torch.arange(D, device=removed.device).repeat(removed.shape[0])
    if operator == "delete":
        n_keep = (batch.attention_mask[src].bool() & ~removed).sum(-1)
        L = removed.shape[1]
        attn_all = (torch.arange(L, device=removed.device)[None, :] < n_keep[:, None]).long()
    else:
        attn_all = batch.attention_mask[src[req]]
    out = torch.zeros(2, req.shape[0], dtype=torch.float64, device=removed.device)
    passes = _passes(attn_all, limits)
    for rows, lo, hi in passes:
        b, rm = src[req[rows]], removed[req[rows]]
        zero_keep = None
        if operator == "delete":
            ids, attn, pos, weight, target = (t[:, lo:hi] for t in _delete_rows(batch, b, rm))
        else:
            ids, attn, pos = (t[b, lo:hi] for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
            weight, target = spec.logit_weight[b, lo:hi], spec.target_ids[b, lo:hi]
            rm = rm[:, lo:hi]
            if operator == "mask":
                ids = torch.where(rm, mask_token_id, ids)
            elif operator == "resample":
                ids = torch.where(rm, clean.sampled[b, lo:hi].gather(-1, draw[rows][:, None, None].expand(
                    -1, hi - lo, 1)).squeeze(-1), ids)
            else:  # zero
                zero_keep = ~rm
        probe, _, _ = _forward(model, ids, attn, pos, weight, target, zero_keep=zero_keep)
        ref = clean.probe.index(b)
        out[0, rows] = outcome_shift(ref, probe, spec.joint[b]).double()
        out[1, rows] = (ref.phi - probe.phi).double()
    out = out.view(2, -1, D).mean(-1)
    out[1] = torch.where(clean.logp_valid[src], out[1], float("nan"))
    return out, len(passes)


def _check(operators: Sequence[str], mask_token_id: int | None, draws: int) -> None:
    bad = [o for o in operators if o not in OPERATORS]
    if bad:
        raise ValueError(f"fidelity: unknown operator(s) {bad}; allowed: {', '.join(OPERATORS)}")
    if not operators:
        raise ValueError(f"fidelity: no operator given; allowed: {', '.join(OPERATORS)}")
    if "mask" in operators and mask_token_id is None:
        raise ValueError("fidelity: operator 'mask' needs mask_token_id (e.g. the tokenizer's pad token, or "
                         "PreparedAttribution.mask_token_id); or drop 'mask' from operators")
    if "resample" in operators and draws < 1:
        raise ValueError(f"fidelity: operator 'resample' needs draws >= 1, got {draws}")


def outcome_shifts(model: torch.nn.Module, batch: AttributionBatch, removed: torch.Tensor, operator: str, *,
                   src: torch.Tensor | None = None, mask_token_id: int | None = None,
                   limits: PassLimits | None = None, seed: int = 0, draws: int = 4) -> torch.Tensor:
    """Outcome shift of removing token sets jointly with one operator (the building block of the deletion curve).

    Args:
        model: a Hugging Face causal LM (plain or FSDP-wrapped); run in eval mode under ``torch.no_grad()``, every
            module's train/eval flag restored.
        batch: AttributionBatch (B, L).
        removed: (N, L) bool, the tokens removed from row ``src[i]`` in perturbed row i (reasoning tokens).
        operator: one of :data:`OPERATORS`.
        src: (N,) long source rows (default: ``arange(B)``, N = B).
        mask_token_id: the ``mask`` operator's token. limits: the token budget of one pass (default 16,384 tokens).
        seed, draws: the ``resample`` operator's draws (D = ``draws``).

    Returns:
        (2, N) float64: [kl, logp] shifts (module docstring); logp NaN where the probe's target is padding.
        Cost: one clean forward per row, then N (``resample``: N·D) perturbed rows packed under the budget.
    """
    _check([operator], mask_token_id, draws)
    src = torch.arange(batch.input_ids.shape[0], device=removed.device) if src is None else src
    limits = limits or PassLimits(DEFAULT_MAX_TOKENS)
    with _preserved(model):
        clean = _clean_pass(model, batch, limits, draws if operator == "resample" else 0, seed)
        return _shifts(model, batch, clean, removed.bool() & batch.reasoning_mask[src], src, operator, limits,
                       mask_token_id)[0]


def leave_one_out_scores(model: torch.nn.Module, batch: AttributionBatch, operator: str, *,
                         mask_token_id: int | None = None, limits: PassLimits | None = None, seed: int = 0,
                         draws: int = 4, measure: str = "kl") -> torch.Tensor:
    """Exact leave-one-out scores for one operator: the shift of removing each reasoning token alone.

    For research use at small R: it runs R perturbed rows per row (R·D for ``resample``), i.e. its cost grows with R
    (exact OAR-P is this function with ``operator="mask"``, without OAR-P's prefix cache). Its ranking is a natural
    "best" candidate of :func:`fidelity_report` (``candidates``): with fractions whose ⌈f·R⌉ is 1 and that operator
    alone, no ranking beats it.

    Args:
        model, batch, mask_token_id, limits, seed, draws: as :func:`outcome_shifts`.
        operator: one of :data:`OPERATORS`. measure: ``kl`` or ``logp`` (:data:`MEASURES`).

    Returns:
        (B, L) float64 scores on the reasoning tokens, 0 elsewhere (NaN on rows whose ``logp`` is undefined).
    """
    if measure not in MEASURES:
        raise ValueError(f"fidelity: unknown measure {measure!r}; allowed: {', '.join(MEASURES)}")
    reasoning = batch.reasoning_mask
    B, L = reasoning.shape
    pos = reasoning.nonzero()  # (N, 2): one perturbed row per reasoning token (host sync once)
    removed = torch.zeros(pos.shape[0], L, dtype=torch.bool, device=reasoning.device)
    removed[torch.arange(pos.shape[0], device=reasoning.device), pos[:, 1]] = True
    shifts = outcome_shifts(model, batch, removed, operator, src=pos[:, 0], mask_token_id=mask_token_id,
                            limits=limits, seed=seed, draws=draws)
    out = torch.zeros(B, L, dtype=torch.float64, device=reasoning.device)
    out[pos[:, 0], pos[:, 1]] = shifts[MEASURES.index(measure)]
    return out


# ------------------------------------------------------------------------------------------------ the formulas
def aopc(curve: torch.Tensor) -> torch.Tensor:
    """Area over the perturbation curve: (..., O, F) shifts -> (...) mean over the F fractions, then the O
    operators."""
    return curve.mean(-1).mean(-1)


def _degenerate(den: torch.Tensor, min_gap: float, *scale: torch.Tensor) -> torch.Tensor:
    tol = torch.clamp(1e-9 * torch.stack([s.abs() for s in scale]).amax(0), min=max(min_gap, 1e-12))
    return ~(den > tol)  # also True for NaN


def naopc(method: torch.Tensor, random: torch.Tensor, best: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """NAOPC = (AOPC_method − AOPC_random) / (AOPC_best − AOPC_random), elementwise; NaN where the denominator is
    not above max(``min_gap``, 1e-12, 1e-9 · max(|best|, |random|)) (best no better than random, within the numerical
    noise of the shifts: the row cannot tell rankings apart) or an input is NaN."""
    den = best - random
    return torch.where(_degenerate(den, min_gap, best, random), float("nan"), (method - random) / den)


def suppression_ratio(bottom: torch.Tensor, random: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """S = shift(remove the method's bottom share) / shift(remove a random share of the same size), elementwise;
    NaN where the random removal's shift is not above max(``min_gap``, 1e-12, 1e-9 · |random|)."""
    return torch.where(_degenerate(random, min_gap, random), float("nan"), bottom / random)


def default_min_gap(model: torch.nn.Module) -> float:
    """The smallest denominator (in shift units) NAOPC and S trust, from the model's parameter dtype: 0 for float64
    (the relative 1e-9 rule alone), 1e-6 for float32, 1e-3 for 16-bit types (a perturbed row runs in another batch
    and padding than its clean row, so even an empty removal shifts by about the dtype's rounding)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return 0.0 if dtype == torch.float64 else 1e-6 if dtype == torch.float32 else 1e-3


def mass_on_target(weights: torch.Tensor, target: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """Share of the gated advantage mass on the target tokens.

    Args:
        weights: (B, L) gated token weights (:func:`oar_verl.core.reshaping.gating.oar_token_weights`).
        target: (B, L) bool target tokens (the best ranking's top share). reasoning: (B, L) bool.

    Returns:
        (B,) float64 Σ_{target} w / Σ_{reasoning} w; NaN on rows without reasoning tokens.
    """
    w = torch.where(reasoning, weights.double(), 0.0)
    tot = w.sum(-1)
    return torch.where(tot > 0, (w * target).sum(-1) / tot, float("nan"))


@dataclass(frozen=True)
class Interval:
    """A mean over rows with a paired-bootstrap percentile interval.

    Attributes:
        mean: the mean over the rows where the value is defined (NaN if none). lo, hi: the interval's bounds.
        rows: rows where the value is defined. undefined: rows where it is NaN (degenerate denominators etc.).
    """

    mean: float
    lo: float
    hi: float
    rows: int
    undefined: int


def bootstrap_mean(values: torch.Tensor, *, resamples: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> list[Interval]:
    """Percentile bootstrap of the NaN-ignoring row mean, vectorised over S statistics sharing one resampling.

    Args:
        values: (S, B); NaN = undefined on that row (excluded from the mean, counted). Rows are resampled jointly
            for all S statistics (paired: a statistic that is a difference of two methods on the same rows gets
            the paired interval).
        resamples: bootstrap resamples. seed: the resampling seed. alpha: 1 − the interval's coverage.

    Returns:
        S :class:`Interval` s.
    """
    v = values.detach().double().cpu()
    S, B = v.shape
    ok = ~torch.isnan(v)
    x = torch.where(ok, v, 0.0)
    n = ok.sum(-1)
    mean = x.sum(-1) / n.clamp(min=1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, max(B, 1), (resamples, B), generator=g)
    bs = x[:, idx].sum(-1) / ok[:, idx].sum(-1).clamp(min=1)  # (S, resamples)
    bs = torch.where(ok[:, idx].any(-1), bs, float("nan"))
    lo = torch.nanquantile(bs, alpha / 2, dim=-1)
    hi = torch.nanquantile(bs, 1 - alpha / 2, dim=-1)
    nan = float("nan")
    return [Interval(float(mean[s]) if n[s] else nan, float(lo[s]) if n[s] else nan,
                     float(hi[s]) if n[s] else nan, int(n[s]), int(B - n[s])) for s in range(S)]


# ------------------------------------------------------------------------------------------------ the report
@dataclass(frozen=True)
class MethodFidelity:
    """One method's numbers per row. The leading axis of size 2 is the measure, :data:`MEASURES` (kl, logp).

    Attributes:
        curve: (2, B, O, F) outcome shift of removing the top ⌈f·R⌉ tokens, per operator and fraction.
        aopc: (2, B) mean of ``curve`` over F then O.
        naopc: (2, B) :func:`naopc` against the report's random and best AOPC (NaN: degenerate row).
        bottom_shift: (2, B) operator-mean shift of removing the bottom ⌈s·R⌉ tokens (s = ``suppress_fraction``).
        suppression: (2, B) :func:`suppression_ratio` of ``bottom_shift`` and the random removal of the same size.
        mass: (B,) share of this method's gated advantage mass on the best ranking's top ⌈t·R⌉ tokens (t =
            ``target_fraction``, best under the report's ``primary`` measure).
    """

    curve: torch.Tensor
    aopc: torch.Tensor
    naopc: torch.Tensor
    bottom_shift: torch.Tensor
    suppression: torch.Tensor
    mass: torch.Tensor


@dataclass(frozen=True)
class FidelityReport:
    """What :func:`fidelity_report` measured (B rows; the leading 2 is the measure axis, :data:`MEASURES`).

    Attributes:
        methods: per method name, its :class:`MethodFidelity`.
        operators, fractions: the O operators and F fractions of the curves.
        candidates: names of the rankings "best" is taken over (the methods, then the extra candidates).
        candidate_aopc: (2, C, B) AOPC of every candidate.
        best_aopc: (2, B) max over the candidates. best: (2, B) long index into ``candidates``.
        random_aopc: (2, B) mean AOPC of the random rankings. random_curve: (2, B, O, F) their mean curve.
        random_shift: (2, B) mean operator-mean shift of removing a random ⌈s·R⌉ tokens (S's denominator).
        reasoning_tokens: (B,) long R per row. target_baseline: (B,) ⌈t·R⌉ / R, the mass of uniform weights.
        forwards: model forward calls run (the clean pass included). forward_rows: perturbed rows run (with draws).
        summary: "<method>/<stat>" -> :class:`Interval` (stats: aopc, naopc, suppression, aopc_logp, naopc_logp,
            suppression_logp, mass).
        primary: the measure "best" (for ``mass``) is chosen by.
    """

    methods: dict[str, MethodFidelity]
    operators: tuple[str, ...]
    fractions: tuple[float, ...]
    candidates: tuple[str, ...]
    candidate_aopc: torch.Tensor
    best_aopc: torch.Tensor
    best: torch.Tensor
    random_aopc: torch.Tensor
    random_curve: torch.Tensor
    random_shift: torch.Tensor
    reasoning_tokens: torch.Tensor
    target_baseline: torch.Tensor
    forwards: int
    forward_rows: int
    primary: str
    resamples: int = 1000
    seed: int = 0
    alpha: float = 0.05
    summary: dict[str, Interval] = field(default_factory=dict)

    def stat(self, method: str, name: str) -> torch.Tensor:
        """(B,) per-row values of one statistic (the names of ``summary``)."""
        m = self.methods[method]
        if name == "mass":
            return m.mass
        base, _, meas = name.partition("_")
        i = MEASURES.index(meas or "kl")
        return {"aopc": m.aopc, "naopc": m.naopc, "suppression": m.suppression}[base][i]

    def difference(self, a: str, b: str, name: str = "naopc") -> Interval:
        """Paired bootstrap of mean(stat_a − stat_b) over the rows where both are defined (same resampling seed)."""
        return bootstrap_mean((self.stat(a, name) - self.stat(b, name))[None], resamples=self.resamples,
                              seed=self.seed, alpha=self.alpha)[0]

    def metrics(self, prefix: str = "oar/fidelity/") -> dict[str, float]:
        """Scalars for a logger: per method and statistic the mean, the interval ("_lo", "_hi") and the undefined
        rows ("_undefined"); plus rows, forwards and the random / best mean AOPC."""
        out: dict[str, float] = {}
        for key, iv in self.summary.items():
            out[f"{prefix}{key}"] = iv.mean
            out[f"{prefix}{key}_lo"] = iv.lo
            out[f"{prefix}{key}_hi"] = iv.hi
            out[f"{prefix}{key}_undefined"] = float(iv.undefined)
        out[f"{prefix}rows"] = float(self.reasoning_tokens.shape[0])
        out[f"{prefix}forwards"] = float(self.forwards)
        out[f"{prefix}forward_rows"] = float(self.forward_rows)
        out[f"{prefix}random_aopc"] = float(torch.nanmean(self.random_aopc[0]))
        out[f"{prefix}best_aopc"] = float(torch.nanmean(self.best_aopc[0]))
        return out


_STATS = ("aopc", "naopc", "suppression", "aopc_logp", "naopc_logp", "suppression_logp", "mass")


def _as_full(scores: torch.Tensor, batch: AttributionBatch, name: str) -> torch.Tensor:
    """(B, L) scores from (B, L) full-sequence or (B, L − P) response-aligned ones."""
    B, L = batch.input_ids.shape
    s = scores.to(batch.input_ids.device)
    if s.shape == (B, L):
        return s
    if s.shape == (B, L - batch.response_start):
        return torch.nn.functional.pad(s, (batch.response_start, 0))
    raise ValueError(f"fidelity: scores {name!r} have shape {tuple(s.shape)}; expected (B, L) = {(B, L)} or the "
                     f"response-aligned {(B, L - batch.response_start)}")


def fidelity_report(model: torch.nn.Module, batch: AttributionBatch, scores: Mapping[str, torch.Tensor], *,
                    mask_token_id: int | None = None, operators: Sequence[str] = OPERATORS,
                    fractions: Sequence[float] = FRACTIONS, limits: PassLimits | None = None, seed: int = 0,
                    gate: tuple[float, float, float] = (0.4, 2.0, 0.1),
                    candidates: Mapping[str, torch.Tensor] | None = None, random_rankings: int = 4, draws: int = 4,
                    suppress_fraction: float = 0.4, target_fraction: float = 0.2, primary: str = "kl",
                    resamples: int = 1000, alpha: float = 0.05, min_gap: float | None = None) -> FidelityReport:
    """Fidelity of token attributions on a batch of rollouts (docs/fidelity.md).

    Args:
        model: the policy, a Hugging Face causal LM (plain or FSDP-wrapped). Runs in eval mode under
            ``torch.no_grad()``; every module's train/eval flag is restored; no parameter or hook is left changed.
        batch: AttributionBatch (B, L) (:func:`oar_verl.core.preprocess.prepare_attribution`).
        scores: method name -> (B, L) importance (as :func:`oar_verl.core.methods.attribution.run_attribution` returns) or
            (B, T) response-aligned; only the reasoning tokens' order matters (ties: the earlier token first).
        mask_token_id: the ``mask`` operator's token (required with it).
        operators: O of :data:`OPERATORS`. fractions: F fractions f in (0, 1] of the deletion curve.
        limits: the token budget of one forward pass (default 16,384 tokens), as the attribution methods use.
        seed: random rankings, resampling draws and the bootstrap.
        gate: (tau, beta, floor) of the gating (the config's ``tau``, ``beta``, ``floor``) for ``mass``.
        candidates: extra rankings (name -> (B, L) scores) that "best" is taken over besides the methods, e.g.
            :func:`leave_one_out_scores` of each operator.
        random_rankings: J >= 1 seeded random rankings for "random". draws: D resampling draws (>= 4 advised).
        suppress_fraction: the bottom share of S. target_fraction: the top share of the best ranking for ``mass``.
        primary: the measure (:data:`MEASURES`) the best ranking for ``mass`` is chosen by.
        resamples, alpha: the paired bootstrap over rows (percentile interval of coverage 1 − alpha).
        min_gap: the smallest NAOPC / S denominator trusted, in shift units (default :func:`default_min_gap`);
            rows below it get NaN and are counted as undefined.

    Returns:
        FidelityReport. Cost: one clean forward per row, then per ranking (M methods + C candidates + J random) one
        forward per operator per fraction (D for ``resample``), plus (M + J) for S; i.e. B·[1 + (M+C+J)·F·O' +
        (M+J)·O'] rows with O' = O − 1 + D if ``resample`` is in ``operators`` else O, independent of R.
    """
    operators = tuple(operators)
    fractions = tuple(float(f) for f in fractions)
    _check(operators, mask_token_id, draws)
    if not scores:
        raise ValueError("fidelity: no method scores given")
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"fidelity: fractions must lie in (0, 1], got {fractions}")
    if random_rankings < 1:
        raise ValueError(f"fidelity: random_rankings must be >= 1, got {random_rankings}")
    if primary not in MEASURES:
        raise ValueError(f"fidelity: unknown measure {primary!r}; allowed: {', '.join(MEASURES)}")
    limits = limits or PassLimits(DEFAULT_MAX_TOKENS)
    reasoning = batch.reasoning_mask.bool()
    B, L = reasoning.shape
    methods = {k: _as_full(v, batch, k) for k, v in scores.items()}
    extra = {k: _as_full(v, batch, k) for k, v in (candidates or {}).items()}
    clash = set(methods) & set(extra)
    if clash:
        raise ValueError(f"fidelity: names used both as methods and candidates: {sorted(clash)}")
    ranked = {**methods, **extra, **{f"random/{j}": random_scores(batch, seed, j) for j in range(random_rankings)}}
    ranks = torch.stack([ranks_from_scores(s, reasoning) for s in ranked.values()])  # (Q, B, L)
    M, C, Q = len(methods), len(extra), len(ranked)
    # removal sets: every ranking's top ⌈f·R⌉ per f, then the methods' bottom and the random rankings' top share
    tops = torch.stack([torch.stack([top_removal(r, reasoning, f) for f in fractions]) for r in ranks])  # (Q,F,B,L)
    bottoms = torch.stack([bottom_removal(r, reasoning, suppress_fraction) for r in ranks[:M]])  # (M, B, L)
    rand_s = torch.stack([top_removal(r, reasoning, suppress_fraction) for r in ranks[M + C:]])  # (J, B, L)
    removed = torch.cat([tops.reshape(-1, B, L), bottoms, rand_s])  # (G, B, L)
    G = removed.shape[0]
    src = torch.arange(B, device=reasoning.device).repeat(G)
    shifts = []
    forwards = forward_rows = 0
    with _preserved(model):
        clean = _clean_pass(model, batch, limits, draws if "resample" in operators else 0, seed)
        forwards += clean.forwards
        for op in operators:  # one batched evaluation per operator: every ranking and fraction, packed
            s, n = _shifts(model, batch, clean, removed.reshape(G * B, L), src, op, limits, mask_token_id)
            shifts.append(s.view(2, G, B))
            forwards += n
            forward_rows += G * B * (draws if op == "resample" else 1)
    shifts = torch.stack(shifts, -1)  # (2, G, B, O)
    curves = shifts[:, :Q * len(fractions)].view(2, Q, len(fractions), B, -1).permute(0, 1, 3, 4, 2)  # (2,Q,B,O,F)
    bottom_shift = shifts[:, Q * len(fractions):Q * len(fractions) + M].mean(-1)  # (2, M, B)
    random_shift = shifts[:, Q * len(fractions) + M:].mean(-1).mean(1)  # (2, B)
    aopcs = aopc(curves)  # (2, Q, B)
    cand_aopc = aopcs[:, :M + C]
    best_aopc, best = torch.nan_to_num(cand_aopc, nan=float("-inf")).max(1)
    best_aopc = torch.where(torch.isinf(best_aopc), float("nan"), best_aopc)
    random_aopc = aopcs[:, M + C:].mean(1)
    # mass on target: the best ranking (under the primary measure) of each row, its top share
    p = MEASURES.index(primary)
    best_rank = ranks[:M + C].gather(0, best[p][None, :, None].expand(1, B, L)).squeeze(0)
    target = top_removal(best_rank, reasoning, target_fraction)
    r_tok = reasoning.sum(-1)
    tau, beta, floor = gate
    gap = default_min_gap(model) if min_gap is None else float(min_gap)
    out = {}
    for i, (name, s) in enumerate(methods.items()):
        w = oar_token_weights(s, reasoning, reasoning, tau, beta, floor).weights
        out[name] = MethodFidelity(curves[:, i], aopcs[:, i], naopc(aopcs[:, i], random_aopc, best_aopc, gap),
                                   bottom_shift[:, i], suppression_ratio(bottom_shift[:, i], random_shift, gap),
                                   mass_on_target(w, target, reasoning))
    baseline = torch.where(r_tok > 0, removal_count(target_fraction, r_tok).double() / r_tok.clamp(min=1),
                           float("nan"))
    report = FidelityReport(out, operators, fractions, tuple(methods) + tuple(extra), cand_aopc, best_aopc, best,
                            random_aopc, curves[:, M + C:].mean(1), random_shift, r_tok, baseline, forwards,
                            forward_rows, primary, resamples, seed, alpha)
    keys = [(m, s) for m in methods for s in _STATS]
    ivs = bootstrap_mean(torch.stack([report.stat(m, s) for m, s in keys]), resamples=resamples, seed=seed,
                         alpha=alpha)
    report.summary.update({f"{m}/{s}": iv for (m, s), iv in zip(keys, ivs)})
    return report
