"""The offline fidelity report a user runs on any Hugging Face causal LM (docs/fidelity.md §2): does a ranking of the
reasoning tokens find the tokens the outcome depends on, whatever "removing a token" means?

For each ranking (the methods' scores, candidate "best" rankings, seeded random rankings) and fraction f, the top
⌈f·R⌉ reasoning tokens of a row are removed jointly with each operator (:mod:`oar_verl.core.fidelity.operators`: the
mask operators of OAR-P plus ``delete``) and the outcome shift is measured in two ways (:data:`~oar_verl.core.fidelity.
shifts.MEASURES`, ``kl`` and ``logp``). The model runs through its module backend
(:class:`~oar_verl.core.backends.hf.ModuleBackend`) and the scorer the in-step metric uses
(:func:`~oar_verl.core.fidelity.shifts.removal_shifts`); the curves give AOPC, NAOPC, S and the mass on target
(:mod:`oar_verl.core.fidelity.summary`), with paired bootstrap intervals. Shapes: B rows, L columns, O operators, F
fractions, M methods, C candidates, J random rankings, N perturbed rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.fidelity.curves import FRACTIONS, deletion_sets, rankings, removal_count, top_removal
from oar_verl.core.fidelity.operators import DEFAULT_OPERATORS, check_operators, operator_draws, resample_seeds
from oar_verl.core.fidelity.shifts import MEASURES, Shifts, removal_shifts
from oar_verl.core.fidelity.summary import (Interval, aopc, bootstrap_mean, default_min_gap, mass_on_target, naopc,
                                            suppression_ratio)
from oar_verl.core.methods.attribution import DEFAULT_MAX_TOKENS
from oar_verl.core.reshaping.gating import oar_token_weights

__all__ = ["FidelityReport", "MethodFidelity", "fidelity_report", "leave_one_out_scores", "outcome_shifts"]

_STATS = ("aopc", "naopc", "suppression", "aopc_logp", "naopc_logp", "suppression_logp", "mass")


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
        forwards: model forward passes run (the clean ones included). forward_rows: perturbed rows run (with draws).
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


@contextlib.contextmanager
def _evaluated(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no gradient inside; every module's train/eval flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            yield
    finally:
        for m, t in flags:
            m.training = t


def _shifts(model: torch.nn.Module, batch: AttributionBatch, removed: torch.Tensor, src: torch.Tensor,
            operators: Sequence[str], *, mask_token_id: int | None, limits: PassLimits | None, seed: int, draws: int,
            seeds: torch.Tensor | None) -> Shifts:
    """:func:`removal_shifts` of the removal sets under ``operators`` on the module's backend, both measures, the
    model in eval mode (left as found)."""
    with _evaluated(model):
        backend = ModuleBackend(model, limits or PassLimits(DEFAULT_MAX_TOKENS), prefix_cache=False)
        row_seeds = resample_seeds(batch, draws, seed, seeds)
        variants = [operator_draws(backend, batch, op, token_id=mask_token_id, seeds=row_seeds) for op in operators]
        return removal_shifts(backend, batch, removed, src, variants, logp=True)


def outcome_shifts(model: torch.nn.Module, batch: AttributionBatch, removed: torch.Tensor, operator: str, *,
                   src: torch.Tensor | None = None, mask_token_id: int | None = None,
                   limits: PassLimits | None = None, seed: int = 0, draws: int = 4,
                   seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Outcome shift of removing token sets jointly with one operator (the building block of the deletion curve).

    Args:
        model: a Hugging Face causal LM (plain or FSDP-wrapped); run in eval mode under ``torch.no_grad()``, every
            module's train/eval flag restored.
        batch: AttributionBatch (B, L).
        removed: (N, L) bool, the tokens removed from row ``src[i]`` in perturbed row i (reasoning tokens).
        operator: one of :data:`~oar_verl.core.fidelity.operators.OPERATORS`.
        src: (N,) long source rows (default: ``arange(B)``, N = B).
        mask_token_id: the token of an inserting operator (``pad``, ``token``). limits: the token budget of one
            pass (default 16,384 tokens).
        seed, draws, seeds: the ``resample`` operator's D = ``draws`` draws
            (:func:`~oar_verl.core.fidelity.operators.resample_seeds`).

    Returns:
        (2, N) float64: [kl, logp] shifts (:mod:`oar_verl.core.fidelity.shifts`); NaN for an empty set, and for
        logp where the probe's target is padding. Cost: one clean forward per row with a set, then N (``resample``:
        N·D) perturbed rows packed under the budget.
    """
    check_operators([operator], mask_token_id, draws)
    src = torch.arange(batch.input_ids.shape[0], device=removed.device) if src is None else src
    removed = removed.bool().to(batch.input_ids.device) & batch.reasoning_mask.bool()[src.to(batch.input_ids.device)]
    return _shifts(model, batch, removed, src, [operator], mask_token_id=mask_token_id, limits=limits, seed=seed,
                   draws=draws, seeds=seeds).values[:, 0]


def leave_one_out_scores(model: torch.nn.Module, batch: AttributionBatch, operator: str, *,
                         mask_token_id: int | None = None, limits: PassLimits | None = None, seed: int = 0,
                         draws: int = 4, measure: str = "kl") -> torch.Tensor:
    """Exact leave-one-out scores for one operator: the shift of removing each reasoning token alone.

    For research use at small R: it runs R perturbed rows per row (R·D for ``resample``), i.e. its cost grows with R
    (exact OAR-P is this function with OAR-P's mask operator, without OAR-P's prefix cache). Its ranking is a
    natural "best" candidate of :func:`fidelity_report` (``candidates``): with fractions whose ⌈f·R⌉ is 1 and that
    operator alone, no ranking beats it.

    Args:
        model, batch, mask_token_id, limits, seed, draws: as :func:`outcome_shifts`.
        operator: one of :data:`~oar_verl.core.fidelity.operators.OPERATORS`. measure: ``kl`` or ``logp``
            (:data:`MEASURES`).

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
                    mask_token_id: int | None = None, operators: Sequence[str] = DEFAULT_OPERATORS,
                    fractions: Sequence[float] = FRACTIONS, limits: PassLimits | None = None, seed: int = 0,
                    gate: tuple[float, float, float] = (0.4, 2.0, 0.1),
                    candidates: Mapping[str, torch.Tensor] | None = None, random_rankings: int = 4, draws: int = 4,
                    seeds: torch.Tensor | None = None, suppress_fraction: float = 0.4, target_fraction: float = 0.2,
                    primary: str = "kl", resamples: int = 1000, alpha: float = 0.05,
                    min_gap: float | None = None) -> FidelityReport:
    """Fidelity of token attributions on a batch of rollouts (docs/fidelity.md).

    Args:
        model: the policy, a Hugging Face causal LM (plain or FSDP-wrapped). Runs in eval mode under
            ``torch.no_grad()``; every module's train/eval flag is restored; no parameter or hook is left changed.
        batch: AttributionBatch (B, L) (:func:`oar_verl.core.preprocess.prepare_attribution`).
        scores: method name -> (B, L) importance (as :func:`oar_verl.core.methods.attribution.run_attribution`
            returns) or (B, T) response-aligned; only the reasoning tokens' order matters (ties: the earlier token
            first).
        mask_token_id: the token of an inserting operator (``pad``, ``token``; required with one).
        operators: O of :data:`~oar_verl.core.fidelity.operators.OPERATORS` (default ``mean``, ``zero``,
            ``delete``, ``resample``). fractions: F fractions f in (0, 1] of the deletion curve.
        limits: the token budget of one forward pass (default 16,384 tokens), as the attribution methods use.
        seed: random rankings, resampling draws and the bootstrap.
        gate: (tau, beta, floor) of the gating (the config's ``tau``, ``beta``, ``floor``) for ``mass``.
        candidates: extra rankings (name -> (B, L) scores) that "best" is taken over besides the methods, e.g.
            :func:`leave_one_out_scores` of each operator.
        random_rankings: J >= 1 seeded random rankings for "random". draws: D ``resample`` draws (>= 4 advised).
        seeds: (B,) int64 row seeds of the ``resample`` draws (default: from ``seed`` and each row's content); with
            the run's ``PreparedAttribution.seeds`` and ``draws=1`` it replaces as the run's OAR-P does.
        suppress_fraction: the bottom share of S. target_fraction: the top share of the best ranking for ``mass``.
        primary: the measure (:data:`MEASURES`) the best ranking for ``mass`` is chosen by.
        resamples, alpha: the paired bootstrap over rows (percentile interval of coverage 1 − alpha).
        min_gap: the smallest NAOPC / S denominator trusted, in shift units (default
            :func:`~oar_verl.core.fidelity.summary.default_min_gap`); rows below it get NaN and are counted as
            undefined.

    Returns:
        FidelityReport (rows without reasoning tokens: NaN). Cost: one clean forward per row, then per ranking (M
        methods + C candidates + J random) one forward per operator per fraction (D for ``resample``), plus (M + J)
        for S; i.e. B·[1 + (M+C+J)·F·O' + (M+J)·O'] rows with O' = O − 1 + D if ``resample`` is in ``operators``
        else O, independent of R.
    """
    operators = check_operators(operators, mask_token_id, draws)
    fractions = tuple(float(f) for f in fractions)
    if not scores:
        raise ValueError("fidelity: no method scores given")
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"fidelity: fractions must lie in (0, 1], got {fractions}")
    if random_rankings < 1:
        raise ValueError(f"fidelity: random_rankings must be >= 1, got {random_rankings}")
    if primary not in MEASURES:
        raise ValueError(f"fidelity: unknown measure {primary!r}; allowed: {', '.join(MEASURES)}")
    reasoning = batch.reasoning_mask.bool()
    B, L = reasoning.shape
    methods = {k: _as_full(v, batch, k) for k, v in scores.items()}
    extra = {k: _as_full(v, batch, k) for k, v in (candidates or {}).items()}
    clash = set(methods) & set(extra)
    if clash:
        raise ValueError(f"fidelity: names used both as methods and candidates: {sorted(clash)}")
    M, C, F = len(methods), len(extra), len(fractions)
    ranks = rankings(batch, [*methods.values(), *extra.values()], random_rankings, seed)  # (Q, B, L)
    Q = ranks.shape[0]
    removed = deletion_sets(ranks, reasoning, fractions, methods=M, random_rankings=random_rankings,
                            suppress_fraction=suppress_fraction)  # (G, B, L)
    G = removed.shape[0]
    got = _shifts(model, batch, removed.reshape(G * B, L), torch.arange(B, device=reasoning.device).repeat(G),
                  operators, mask_token_id=mask_token_id, limits=limits, seed=seed, draws=draws, seeds=seeds)
    shifts = got.values.view(2, -1, G, B).permute(0, 2, 3, 1)  # (2, G, B, O)
    curves = shifts[:, :Q * F].view(2, Q, F, B, -1).permute(0, 1, 3, 4, 2)  # (2, Q, B, O, F)
    bottom_shift = shifts[:, Q * F:Q * F + M].mean(-1)  # (2, M, B)
    random_shift = shifts[:, Q * F + M:].mean(-1).mean(1)  # (2, B)
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
                            random_aopc, curves[:, M + C:].mean(1), random_shift, r_tok, baseline, got.passes,
                            got.rows, primary, resamples, seed, alpha)
    keys = [(m, s) for m in methods for s in _STATS]
    ivs = bootstrap_mean(torch.stack([report.stat(m, s) for m, s in keys]), resamples=resamples, seed=seed,
                         alpha=alpha)
    report.summary.update({f"{m}/{s}": iv for (m, s), iv in zip(keys, ivs)})
    return report
