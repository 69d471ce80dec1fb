"""The offline fidelity report a user runs on any Hugging Face causal LM (docs/fidelity.md §2): does a ranking of the
reasoning tokens find the tokens the outcome depends on, whatever "removing a token" means?

For each ranking (the methods' scores, candidate "best" rankings, the controls, seeded random rankings) and fraction
f, the top
⌈f·R⌉ reasoning tokens of a row are removed jointly with each operator (:mod:`oar_verl.core.fidelity.operators`: the
mask operators of OAR-P plus ``delete``) and the outcome shift is measured in two ways (:data:`~oar_verl.core.fidelity.
shifts.MEASURES`, ``kl`` and ``logp``). The model runs through its module backend
(:class:`~oar_verl.core.backends.hf.ModuleBackend`) and the scorer the in-step metric uses
(:func:`~oar_verl.core.fidelity.shifts.removal_shifts`); the curves give each method's gain over each control (the
primary statistic, :mod:`oar_verl.core.fidelity.controls`), AOPC, NAOPC (secondary: it names its candidate set), S and
the mass on target (:mod:`oar_verl.core.fidelity.summary`), with paired bootstrap intervals clustered by prompt.
Shapes: B rows, L columns, O operators, F fractions, M methods, C candidates, K controls that are one ranking
(position, entropy), J random rankings, N perturbed rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.fidelity.controls import CONTROLS, DEFAULT_CONTROLS, check_controls, control_scores, evaluated
from oar_verl.core.fidelity.curves import (FRACTIONS, deletion_sets, full_columns, rankings, removal_count,
                                           top_removal)
from oar_verl.core.fidelity.operators import DEFAULT_OPERATORS, check_operators, operator_draws, resample_seeds
from oar_verl.core.fidelity.shifts import MEASURES, Shifts, removal_shifts
from oar_verl.core.fidelity.summary import (Interval, aopc, bootstrap_mean, bootstrap_ratio, clusters, default_min_gap,
                                            gain, mass_on_target, naopc, static_rows, suppression_ratio)
from oar_verl.core.methods.attribution import DEFAULT_MAX_TOKENS
from oar_verl.core.reshaping.gating import oar_token_weights

__all__ = ["FidelityReport", "MethodFidelity", "fidelity_report", "leave_one_out_scores", "outcome_shifts"]

_STATS = ("aopc", "naopc", "suppression", "aopc_logp", "naopc_logp", "suppression_logp", "mass")


def _suffix(measure: str) -> str:
    """A statistic's name suffix for a measure: none for ``kl``, ``_logp`` for ``logp``."""
    return "" if measure == MEASURES[0] else f"_{measure}"


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
        gain: control -> (2, B) per-row gain AOPC_method − AOPC_control
            (:func:`~oar_verl.core.fidelity.summary.gain`), in shift units.
        gain_over: "<control>" (kl) / "<control>_logp" -> the primary statistic: Σ_rows gain / Σ_rows AOPC_control
            over every row where both are defined (:func:`~oar_verl.core.fidelity.summary.ratio_of_sums`), with its
            clustered bootstrap interval. A function of this method's and the control's curves only.
        mean_gain_over: the same keys -> the plain mean gain (shift units) with its interval.
    """

    curve: torch.Tensor
    aopc: torch.Tensor
    naopc: torch.Tensor
    bottom_shift: torch.Tensor
    suppression: torch.Tensor
    mass: torch.Tensor
    gain: dict[str, torch.Tensor] = field(default_factory=dict)
    gain_over: dict[str, Interval] = field(default_factory=dict)
    mean_gain_over: dict[str, Interval] = field(default_factory=dict)


@dataclass(frozen=True)
class FidelityReport:
    """What :func:`fidelity_report` measured (B rows; the leading 2 is the measure axis, :data:`MEASURES`).

    Attributes:
        methods: per method name, its :class:`MethodFidelity`.
        operators, fractions: the O operators and F fractions of the curves.
        candidates: names of the rankings "best" is taken over (the methods, then the extra candidates; never the
            controls): NAOPC's candidate set, also :attr:`naopc_candidates`.
        candidate_aopc: (2, C, B) AOPC of every candidate.
        best_aopc: (2, B) max over the candidates. best: (2, B) long index into ``candidates``.
        random_aopc: (2, B) mean AOPC of the random rankings. random_curve: (2, B, O, F) their mean curve.
        random_shift: (2, B) mean operator-mean shift of removing a random ⌈s·R⌉ tokens (S's denominator).
        reasoning_tokens: (B,) long R per row. target_baseline: (B,) ⌈t·R⌉ / R, the mass of uniform weights.
        forwards: model forward passes run (the clean ones included). forward_rows: perturbed rows run (with draws).
        summary: "<method>/<stat>" -> :class:`Interval` (stats: aopc, naopc, suppression, aopc_logp, naopc_logp,
            suppression_logp, mass; per control c: gain_over_<c>, mean_gain_over_<c> and their ``_logp``).
        primary: the measure "best" (for ``mass``) is chosen by.
        resamples, seed, alpha: the bootstrap's.
        controls: the controls the gains are over (:data:`~oar_verl.core.fidelity.controls.CONTROLS`).
        control_aopc: control -> (2, B) its AOPC (``random``: the mean over the J random rankings).
        static: (2, B) bool rows where nothing moves: every ranking's |AOPC| within ``min_gap``
            (:func:`~oar_verl.core.fidelity.summary.static_rows`); counted, and kept in every sum.
        groups: (B,) long cluster index of each row (rows of one prompt resample together). clusters: K.
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
    controls: tuple[str, ...] = ()
    control_aopc: dict[str, torch.Tensor] = field(default_factory=dict)
    static: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    clusters: int = 0
    summary: dict[str, Interval] = field(default_factory=dict)

    @property
    def naopc_candidates(self) -> tuple[str, ...]:
        """The rankings NAOPC's "best" is taken over: NAOPC compares only between reports with the same set."""
        return self.candidates

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
        return bootstrap_mean((self.stat(a, name) - self.stat(b, name))[None], groups=self.groups,
                              resamples=self.resamples, seed=self.seed, alpha=self.alpha)[0]

    def metrics(self, prefix: str = "oar/fidelity/") -> dict[str, float]:
        """Scalars for a logger: per method and statistic the mean, the interval ("_lo", "_hi"), the undefined
        rows ("_undefined") and the share of bootstrap resamples the interval left out as undefined ("_dropped"); plus
        rows, clusters, ``rows_static`` (and ``rows_static_logp``), forwards, the size of NAOPC's candidate set and
        the random / best / each control's mean AOPC."""
        out: dict[str, float] = {}
        for key, iv in self.summary.items():
            out[f"{prefix}{key}"] = iv.mean
            out[f"{prefix}{key}_lo"] = iv.lo
            out[f"{prefix}{key}_hi"] = iv.hi
            out[f"{prefix}{key}_undefined"] = float(iv.undefined)
            out[f"{prefix}{key}_dropped"] = iv.dropped
        out[f"{prefix}rows"] = float(self.reasoning_tokens.shape[0])
        out[f"{prefix}clusters"] = float(self.clusters)
        if self.static is not None:
            for i, meas in enumerate(MEASURES):
                out[f"{prefix}rows_static{_suffix(meas)}"] = float(self.static[i].sum())
        out[f"{prefix}naopc_candidates"] = float(len(self.naopc_candidates))
        for c, a in self.control_aopc.items():
            if c != "random":
                out[f"{prefix}{c}_aopc"] = float(torch.nanmean(a[0]))
        out[f"{prefix}forwards"] = float(self.forwards)
        out[f"{prefix}forward_rows"] = float(self.forward_rows)
        out[f"{prefix}random_aopc"] = float(torch.nanmean(self.random_aopc[0]))
        out[f"{prefix}best_aopc"] = float(torch.nanmean(self.best_aopc[0]))
        return out

    def table(self, measure: str = "kl") -> str:
        """A plain-text table: per method its gain over each control (the primary statistic, ratio of sums with the
        interval), NAOPC (naming its candidate set) and S, under ``measure``; the rows, clusters and static rows."""
        if measure not in MEASURES:
            raise ValueError(f"fidelity: unknown measure {measure!r}; allowed: {', '.join(MEASURES)}")
        sfx = _suffix(measure)
        fmt = (lambda iv: f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]"
               + (f" ({100 * iv.dropped:.0f} % of resamples undefined)" if iv.dropped > 0 else ""))
        head = ["method", *(f"gain over {c}" for c in self.controls), "NAOPC", "S"]
        rows = [[name, *(fmt(m.gain_over[c + sfx]) for c in self.controls), fmt(self.summary[f"{name}/naopc{sfx}"]),
                 fmt(self.summary[f"{name}/suppression{sfx}"])] for name, m in self.methods.items()]
        width = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        line = (lambda r: "  ".join(x.ljust(w) for x, w in zip(r, width)).rstrip())
        i = MEASURES.index(measure)
        static = "?" if self.static is None else int(self.static[i].sum())
        return "\n".join([
            f"fidelity ({measure}) on {self.reasoning_tokens.shape[0]} rows in {self.clusters} clusters, "
            f"{static} static (nothing moves; kept in the sums); operators {', '.join(self.operators)}",
            line(head), *map(line, rows),
            "gain over c = Σ(AOPC_method − AOPC_c) / Σ AOPC_c over every row, "
            f"{100 * (1 - self.alpha):.0f} % bootstrap clustered by prompt",
            f"NAOPC (secondary) against the best of: {', '.join(self.naopc_candidates)}"])


def _shifts(model: torch.nn.Module, batch: AttributionBatch, removed: torch.Tensor, src: torch.Tensor,
            operators: Sequence[str], *, mask_token_id: int | None, limits: PassLimits | None, seed: int, draws: int,
            seeds: torch.Tensor | None) -> Shifts:
    """:func:`removal_shifts` of the removal sets under ``operators`` on the module's backend, both measures, the
    model in eval mode (left as found)."""
    with evaluated(model):
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


def fidelity_report(model: torch.nn.Module, batch: AttributionBatch, scores: Mapping[str, torch.Tensor], *,
                    mask_token_id: int | None = None, operators: Sequence[str] = DEFAULT_OPERATORS,
                    fractions: Sequence[float] = FRACTIONS, limits: PassLimits | None = None, seed: int = 0,
                    gate: tuple[float, float, float] = (0.4, 2.0, 0.1),
                    candidates: Mapping[str, torch.Tensor] | None = None, random_rankings: int = 4, draws: int = 4,
                    seeds: torch.Tensor | None = None, suppress_fraction: float = 0.4, target_fraction: float = 0.2,
                    primary: str = "kl", resamples: int = 1000, alpha: float = 0.05,
                    min_gap: float | None = None, controls: Sequence[str] = DEFAULT_CONTROLS,
                    entropy: torch.Tensor | None = None, groups: torch.Tensor | None = None) -> FidelityReport:
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
        min_gap: the noise floor in shift units (default :func:`~oar_verl.core.fidelity.summary.default_min_gap`):
            NAOPC / S denominators not above it give NaN rows (counted as undefined); rows where every ranking's
            |AOPC| is within it are ``static`` (counted, kept in the gains' sums).
        controls: what each method's gain is measured over
            (:data:`~oar_verl.core.fidelity.controls.CONTROLS`: ``random``, ``position``, ``entropy``); the controls
            are not NAOPC candidates.
        entropy: (B, L) or response-aligned (B, T) precomputed next-token entropies for the ``entropy`` control (e.g.
            the old-log-prob pass's); default :func:`~oar_verl.core.fidelity.controls.entropy_scores` of ``model``.
        groups: (B,) integer cluster ids (e.g. each row's prompt index): the bootstrap resamples clusters, a
            cluster's rows together (default: every row its own cluster).

    Returns:
        FidelityReport (rows without reasoning tokens: NaN). Cost: one clean forward per row, then per ranking (M
        methods + C candidates + K one-ranking controls + J random) one forward per operator per fraction (D for
        ``resample``), plus (M + J) for S; i.e. B·[1 + (M+C+K+J)·F·O' + (M+J)·O'] rows with O' = O − 1 + D if
        ``resample`` is in ``operators`` else O, independent of R; plus, for ``entropy`` without ``entropy=``, one
        forward per row with logits at its reasoning positions.
    """
    operators = check_operators(operators, mask_token_id, draws)
    controls = check_controls(controls)
    fractions = tuple(float(f) for f in fractions)
    if not scores:
        raise ValueError("fidelity: no method scores given")
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"fidelity: fractions must lie in (0, 1], got {fractions}")
    if random_rankings < 1:
        raise ValueError(f"fidelity: random_rankings must be >= 1, got {random_rankings}")
    if primary not in MEASURES:
        raise ValueError(f"fidelity: unknown measure {primary!r}; allowed: {', '.join(MEASURES)}")
    if entropy is not None and "entropy" not in controls:
        raise ValueError(f"fidelity: entropy= was given but 'entropy' is not in controls={controls}")
    reasoning = batch.reasoning_mask.bool()
    B, L = reasoning.shape
    index, n_clusters = clusters(groups, B)
    methods = {k: full_columns(v, batch, k) for k, v in scores.items()}
    extra = {k: full_columns(v, batch, k) for k, v in (candidates or {}).items()}
    clash = set(methods) & set(extra)
    if clash:
        raise ValueError(f"fidelity: names used both as methods and candidates: {sorted(clash)}")
    ctrl = {c: control_scores(c, batch, model, entropy if c == "entropy" else None)
            for c in controls if CONTROLS.get(c).scores is not None}  # the controls that are one ranking
    M, C, K, F = len(methods), len(extra), len(ctrl), len(fractions)
    ranks = rankings(batch, [*methods.values(), *extra.values(), *ctrl.values()], random_rankings, seed)  # (Q, B, L)
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
    random_aopc = aopcs[:, M + C + K:].mean(1)
    one = dict(zip(ctrl, aopcs[:, M + C:M + C + K].unbind(1)))
    control_aopc = {c: one.get(c, random_aopc) for c in controls}  # random: the mean of the J rankings
    # mass on target: the best ranking (under the primary measure) of each row, its top share
    p = MEASURES.index(primary)
    best_rank = ranks[:M + C].gather(0, best[p][None, :, None].expand(1, B, L)).squeeze(0)
    target = top_removal(best_rank, reasoning, target_fraction)
    r_tok = reasoning.sum(-1)
    tau, beta, floor = gate
    gap = default_min_gap(model) if min_gap is None else float(min_gap)
    boot = dict(groups=index, resamples=resamples, seed=seed, alpha=alpha)
    # the primary statistic: per method, control and measure, from the method's and the control's AOPC only
    gains = {m: {c: gain(aopcs[:, i], control_aopc[c]) for c in controls} for i, m in enumerate(methods)}
    keys = [(m, c, i) for m in methods for c in controls for i in range(len(MEASURES))]
    ratio_ivs, mean_ivs = [], []
    if keys:
        num = torch.stack([gains[m][c][i] for m, c, i in keys])
        ratio_ivs = bootstrap_ratio(num, torch.stack([control_aopc[c][i] for _, c, i in keys]), min_gap=gap, **boot)
        mean_ivs = bootstrap_mean(num, **boot)
    named = {m: {} for m in methods}
    for (m, c, i), r, g in zip(keys, ratio_ivs, mean_ivs):
        named[m][c + _suffix(MEASURES[i])] = (r, g)
    out = {}
    for i, (name, s) in enumerate(methods.items()):
        w = oar_token_weights(s, reasoning, reasoning, tau, beta, floor).weights
        out[name] = MethodFidelity(curves[:, i], aopcs[:, i], naopc(aopcs[:, i], random_aopc, best_aopc, gap),
                                   bottom_shift[:, i], suppression_ratio(bottom_shift[:, i], random_shift, gap),
                                   mass_on_target(w, target, reasoning), gains[name],
                                   {k: v[0] for k, v in named[name].items()},
                                   {k: v[1] for k, v in named[name].items()})
    baseline = torch.where(r_tok > 0, removal_count(target_fraction, r_tok).double() / r_tok.clamp(min=1),
                           float("nan"))
    report = FidelityReport(out, operators, fractions, tuple(methods) + tuple(extra), cand_aopc, best_aopc, best,
                            random_aopc, curves[:, M + C + K:].mean(1), random_shift, r_tok, baseline, got.passes,
                            got.rows, primary, resamples, seed, alpha, controls=controls, control_aopc=control_aopc,
                            static=static_rows(aopcs, gap), groups=index, clusters=n_clusters)
    stat_keys = [(m, s) for m in methods for s in _STATS]
    ivs = bootstrap_mean(torch.stack([report.stat(m, s) for m, s in stat_keys]), **boot)
    report.summary.update({f"{m}/{s}": iv for (m, s), iv in zip(stat_keys, ivs)})
    for m in methods:
        for k, (r, g) in named[m].items():
            report.summary[f"{m}/gain_over_{k}"] = r
            report.summary[f"{m}/mean_gain_over_{k}"] = g
    return report
