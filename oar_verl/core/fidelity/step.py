"""The fidelity deletion metric inside the training step, on every backend (docs/fidelity.md §5).

The offline report's metric (:mod:`oar_verl.core.fidelity.report`) on the step's own attribution, through the same
scorer (:func:`~oar_verl.core.fidelity.shifts.removal_shifts`) over the backend interface, so that it runs on every
engine (a Hugging Face module, Ulysses, Megatron) with the data-parallel rank alignment of the attribution methods.

Per row, ranking r (the method's importance, the position control, the entropy control where the step has
entropies, J seeded random rankings) and fraction f, the row's top ⌈f·R⌉ reasoning
tokens under r are replaced **jointly** by the run's mask operator (``algorithm.oar.mask``), and the outcome shift
KL(P_clean ‖ P_perturbed) (φ_clean − φ on AS-Joint rows) is read; plus the method's bottom ⌈s·R⌉ and each random
ranking's top ⌈s·R⌉ (s = ``suppress_fraction``) for the suppression ratio S. Only the run's own operator and no "best"
ranking: no NAOPC here (:func:`~oar_verl.core.fidelity.report.fidelity_report` has them); the gains over the controls
instead. Cost: one clean forward per row and G perturbed rows per row, packed under the backend's token budget;
independent of R. Shapes: B rows, L columns, P controls (1, or 2 with entropy), G = (1 + P + J)·F + 1 + J removal sets
per row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from oar_verl.core.backends.base import AttributionBackend, Replacement
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.fidelity.controls import control_scores
from oar_verl.core.fidelity.curves import FRACTIONS, deletion_sets, rankings
from oar_verl.core.fidelity.shifts import removal_shifts, replacement_rows, rows_of
from oar_verl.core.fidelity.summary import gain, ratio_of_sums, static_rows, suppression_ratio

__all__ = ["CONTROL_FIELDS", "FIELDS", "RANDOM_RANKINGS", "deletion_metrics", "due", "measured_rows", "removal_sets",
           "step_fidelity",
           "step_metrics"]

# the per-row results, in the order deletion_metrics returns them
FIELDS = ("aopc", "aopc_random", "gain", "suppression", "aopc_position", "aopc_entropy", "static")
RANDOM_RANKINGS = 4  # J of the in-step measurement: the offline report's default
# control -> the per-row field of its AOPC: the gains step_metrics logs (the entropy control only where it was given)
CONTROL_FIELDS = {"random": "aopc_random", "position": "aopc_position", "entropy": "aopc_entropy"}


def _check(fractions: tuple[float, ...], random_rankings: int) -> None:
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"fidelity: fractions must lie in (0, 1], got {fractions}")
    if random_rankings < 1:
        raise ValueError(f"fidelity: random_rankings must be >= 1, got {random_rankings}")


def removal_sets(batch: AttributionBatch, importance: torch.Tensor, *, fractions: Sequence[float],
                 random_rankings: int, seed: int, suppress_fraction: float,
                 controls: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """(G, B, L) bool removal sets, G = (1 + P + J)·F + 1 + J for P ``controls`` ((B, L) scores each), in this order:
    the method's top ⌈f·R⌉ per f, then each control's and each random ranking's top ⌈f·R⌉ per f (ranking-major), then
    the method's bottom ⌈s·R⌉, then each random ranking's top ⌈s·R⌉
    (:func:`~oar_verl.core.fidelity.curves.deletion_sets` of one method: the report's order)."""
    ranks = rankings(batch, [importance, *controls], random_rankings, seed)
    return deletion_sets(ranks, batch.reasoning_mask.bool(), fractions, methods=1, random_rankings=random_rankings,
                         suppress_fraction=suppress_fraction)


def deletion_metrics(backend: AttributionBackend, batch: AttributionBatch, importance: torch.Tensor, *,
                     replacement: Replacement, fractions: Sequence[float] = FRACTIONS,
                     random_rankings: int = RANDOM_RANKINGS, seed: int = 0, suppress_fraction: float = 0.4,
                     min_gap: float = 0.0, entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-row deletion metric of ``importance`` on any backend (see the module docstring).

    Args:
        backend: the model runtime (its ``align`` makes every data-parallel rank run the same pass count: a rank with
            fewer rows, or rows without reasoning tokens, runs filler passes).
        batch: AttributionBatch (B, L), B >= 1.
        importance: (B, L) the method's scores in full-sequence columns (only the reasoning tokens' order matters;
            ties: the earlier token first; NaN ranks last).
        replacement: what replaces the removed tokens (the run's mask operator,
            :func:`~oar_verl.core.methods.mask_operator.mask_replacement` of this batch).
        fractions: F fractions in (0, 1] of the deletion curve. random_rankings: J >= 1. seed: the random rankings'
            seed (a row's ranking depends on the seed and the row's content only).
        suppress_fraction: the bottom share s of S, in (0, 1].
        min_gap: the smallest random-side denominator trusted (shift units, e.g.
            :func:`~oar_verl.core.fidelity.summary.default_min_gap` of the model); below it ``gain`` /
            ``suppression`` are NaN; rows where every ranking's |AOPC| is within it are ``static``.
        entropy: (B, L) (or response-aligned (B, T)) the policy's next-token entropies of these rows
            (:func:`~oar_verl.core.fidelity.controls.entropy_scores`, or the old-log-prob pass's): the entropy
            control; None: skipped (``aopc_entropy`` NaN).

    Returns:
        ``aopc``, ``aopc_random``, ``aopc_position``, ``aopc_entropy`` (B,) float64: mean over f of the shift under
        the method's / the random rankings' (also the mean over J) / the position control's / the entropy control's
        removal; ``gain`` = aopc / aopc_random and ``suppression`` = shift(the method's bottom share) / shift(random
        share of the same size) (:func:`~oar_verl.core.fidelity.summary.suppression_ratio`), NaN below ``min_gap``;
        ``static``: 1.0 where nothing moves (every ranking's |AOPC| within ``min_gap``), else 0.0; all NaN on rows
        without reasoning tokens; ``passes``: (B,) the passes this rank needed (clean and perturbed, before
        alignment), the same on every row. Cost: (1 + P + J)·F + 1 + J perturbed rows per row, P = 1 (position) or
        2 (with entropy).
    """
    fractions = tuple(float(f) for f in fractions)
    _check(fractions, random_rankings)
    B, L = batch.input_ids.shape
    controls = [control_scores("position", batch, None)]
    if entropy is not None:
        controls.append(control_scores("entropy", batch, None, entropy))
    removed = removal_sets(batch, importance, fractions=fractions, random_rankings=random_rankings, seed=seed,
                           suppress_fraction=suppress_fraction, controls=controls)
    G = removed.shape[0]
    src = torch.arange(B, device=batch.input_ids.device).repeat(G)  # set g·B + b removes from row b
    got = removal_shifts(backend, batch, removed.reshape(G * B, L), src, [[replacement]])
    return _summary(got.values[0, 0].view(G, B), len(fractions), len(controls), random_rankings, min_gap, got.passes)


def _summary(shift: torch.Tensor, F: int, P: int, J: int, min_gap: float, passes: int) -> dict[str, torch.Tensor]:
    """The per-row metrics from the (G, B) shifts of :func:`removal_sets`' order with P controls (position, then
    entropy if P = 2) (NaN: an empty removal set)."""
    Q = 1 + P + J
    aopc = shift[:Q * F].view(Q, F, -1).mean(1)  # (Q, B): mean over f (summary.aopc with one operator)
    bottom, rand_s = shift[Q * F], shift[Q * F + 1:].mean(0)
    rand = aopc[1 + P:].mean(0)
    nan = torch.full_like(rand, float("nan"))
    return {"aopc": aopc[0], "aopc_random": rand,
            "gain": suppression_ratio(aopc[0], rand, min_gap),  # the same guarded ratio: method over random
            "suppression": suppression_ratio(bottom, rand_s, min_gap),
            "aopc_position": aopc[1], "aopc_entropy": aopc[2] if P == 2 else nan,
            "static": torch.where(aopc[0].isnan(), nan, static_rows(aopc, min_gap).to(rand.dtype)),
            "passes": torch.full_like(rand, float(passes))}


def due(cfg, global_step: int) -> bool:
    """Whether the step measures fidelity: ``fidelity_every`` > 0 and the step a multiple of it."""
    return cfg.fidelity_every > 0 and global_step % cfg.fidelity_every == 0


def measured_rows(has_reasoning: torch.Tensor, cfg) -> torch.Tensor:
    """(k,) long, k <= ``cfg.fidelity_rows``: the rows a step measures (the in-step metric, ``mode=auto``'s
    calibration, the entropies an integration computes for them): the first rows with reasoning tokens.

    Args:
        has_reasoning: (B,) bool rows with reasoning tokens (host sync, once per step).
    """
    return has_reasoning.bool().nonzero().squeeze(1)[:cfg.fidelity_rows]


def step_fidelity(backend: AttributionBackend, batch: AttributionBatch, importance: torch.Tensor, cfg,
                  global_step: int, *, replacement: Replacement | None, min_gap: float = 0.0,
                  entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A rank's fidelity measurement of a training step: on a :func:`due` step, :func:`deletion_metrics` of the first
    ``cfg.fidelity_rows`` rows with reasoning tokens (the attribution's own importance, the run's mask operator,
    :data:`~oar_verl.core.fidelity.curves.FRACTIONS`, J = :data:`RANDOM_RANKINGS` rankings seeded by ``cfg.seed``,
    S's share = ``cfg.tau``: the share the gating suppresses), timed.

    Args:
        backend, batch (B, L), importance (B, L): as the attribution ran them. cfg: OARConfig.
        global_step: the training step. replacement: the run's mask operator on ``batch``
            (:func:`~oar_verl.core.methods.mask_operator.mask_replacement`; None only on a step not :func:`due`).
            min_gap: as :func:`deletion_metrics`.
        entropy: (B, L) or response-aligned (B, T) next-token entropies of the batch's rows (e.g. the old-log-prob
            pass's): the entropy control. None (the verl worker passes none yet): the entropy control is skipped,
            ``aopc_entropy`` is NaN and ``gain_over_entropy`` is not logged; nothing stands in for it.

    Returns:
        :data:`FIELDS`, ``passes`` and ``seconds`` (this rank's time measuring), each (B,) float64 on the CPU: NaN on
        the rows not measured, everywhere on a step not due. A rank whose rows have no reasoning tokens measures
        nothing but runs the passes the other ranks run.
    """
    B = batch.input_ids.shape[0]
    out = {k: torch.full((B,), float("nan"), dtype=torch.float64) for k in FIELDS + ("passes", "seconds")}
    if not due(cfg, global_step):
        return out
    start = time.perf_counter()
    has = measured_rows(batch.reasoning_mask.bool().any(-1), cfg)
    rows = has if has.numel() else torch.zeros(min(B, 1), dtype=torch.long, device=has.device)  # fillers only
    sub = rows_of(batch, rows)
    ent = None if entropy is None else control_scores("entropy", batch, None, entropy)[rows]
    got = deletion_metrics(backend, sub, importance[rows], replacement=replacement_rows(replacement, rows),
                           random_rankings=RANDOM_RANKINGS, seed=cfg.seed, suppress_fraction=cfg.tau,
                           min_gap=min_gap, entropy=ent)
    for k, v in got.items():
        out[k][rows.cpu()] = v.double().cpu()  # on the CPU: the device work is done when the clock stops
    out["seconds"][:] = time.perf_counter() - start
    return out


def step_metrics(values: dict[str, torch.Tensor], prefix: str = "oar/fidelity/") -> dict[str, float]:
    """Scalars for the trainer's logger from the per-row values of :func:`step_fidelity` (gathered over the ranks).

    Args:
        values: ``aopc``, ``aopc_random``, ``suppression`` (N,) (NaN: not measured / undefined); optionally
            ``aopc_position``, ``aopc_entropy`` and ``static`` (a key missing, or NaN on every measured row: its
            metrics are not logged).

    Returns:
        ``aopc``, ``aopc_random``, ``suppression`` (and ``aopc_position``, ``aopc_entropy``): means over the rows
        where each is defined; ``gain``: mean AOPC over mean random AOPC (a ratio of means: stable when one row's
        random AOPC is tiny; NaN if that is not positive); ``gain_over_<control>`` for random, position and entropy:
        Σ(AOPC − AOPC_control) / Σ AOPC_control over the rows where both are defined, none dropped for its value
        (:func:`~oar_verl.core.fidelity.summary.ratio_of_sums`); ``rows``: rows measured; ``rows_static``: measured
        rows where nothing moved (kept in the sums); ``suppression_undefined``: measured rows whose S had a too small
        random denominator. Empty when no row was measured.
    """
    aopc = values["aopc"].double()
    measured = ~aopc.isnan()
    n = int(measured.sum())
    if n == 0:
        return {}
    mean = {k: float(values[k].double().nanmean()) for k in ("aopc", "aopc_random", "suppression")}
    rand = mean["aopc_random"]
    out = {**{prefix + k: v for k, v in mean.items()},
           prefix + "gain": mean["aopc"] / rand if rand > 0 else float("nan"),
           prefix + "rows": float(n),
           prefix + "suppression_undefined": float((values["suppression"].double().isnan() & measured).sum())}
    for control, key in CONTROL_FIELDS.items():
        ctrl = values.get(key)
        if ctrl is None or not bool((~ctrl.double().isnan() & measured).any()):
            continue  # not measured (the entropy control without entropies): absent, not faked
        ctrl = ctrl.double()
        if key != "aopc_random":
            out[prefix + key] = float(ctrl.nanmean())
        out[prefix + f"gain_over_{control}"] = float(ratio_of_sums(gain(aopc, ctrl), ctrl))
    if "static" in values:
        out[prefix + "rows_static"] = float((values["static"].double() == 1).sum())
    return out
