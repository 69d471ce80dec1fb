"""Outcome shifts of removal sets on any backend: the one place the fidelity metric runs the model, for the offline
report (:mod:`oar_verl.core.fidelity.report`) and the in-step metric (:mod:`oar_verl.core.fidelity.step`), over the
interface of :mod:`oar_verl.core.backends.base`.

Each removal set becomes a copy of its source row in one *expanded batch*, replacing exactly the set's tokens
(``delete`` drops them instead), read against the row's clean probe in the :data:`MEASURES` ``kl`` and ``logp``
(docs/fidelity.md §1, and §3 "One expanded batch"). Shapes: B rows, L columns, N removal sets, n non-empty ones,
O operators, E expanded rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from oar_verl.core.backends.base import AttributionBackend, Pass, Replacement, first_row, shift_callback, with_fillers
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.fidelity.operators import Variant, deleted_rows

__all__ = ["MEASURES", "Shifts", "logp_defined", "removal_shifts", "replacement_rows", "rows_of"]

MEASURES = ("kl", "logp")


class Shifts(NamedTuple):
    """What :func:`removal_shifts` measured: ``values`` (S, O, N) float64 (S measures, NaN for an empty removal set),
    ``passes`` this rank needed (clean and perturbed, before alignment), ``rows`` perturbed rows run (with draws)."""

    values: torch.Tensor
    passes: int
    rows: int


def rows_of(batch: AttributionBatch, rows: torch.Tensor) -> AttributionBatch:
    """The batch's rows ``rows`` (n,) (repeats allowed), same columns: (n, L) everywhere."""
    pick = (lambda t: None if t is None else t[rows])
    return dataclasses.replace(batch, input_ids=pick(batch.input_ids), attention_mask=pick(batch.attention_mask),
                               position_ids=pick(batch.position_ids), reasoning_mask=pick(batch.reasoning_mask),
                               probe=batch.probe.index(rows), segments=pick(batch.segments))


def replacement_rows(replacement: Replacement, rows: torch.Tensor) -> Replacement:
    """A batch's Replacement on the batch whose row i is row ``rows[i]``: per-position ids (``resample``) follow
    their rows; a token or an embedding vector is the same for every row."""
    if replacement.ids is None:
        return replacement
    return dataclasses.replace(replacement, ids=replacement.ids[rows.to(replacement.ids.device)])


def logp_defined(batch: AttributionBatch) -> torch.Tensor:
    """(B,) bool: the ``logp`` measure is defined (the row reads a probe, and a real token follows every position it
    reads)."""
    w = batch.probe.logit_weight != 0
    next_real = torch.zeros_like(w)
    next_real[:, :-1] = batch.attention_mask[:, 1:].bool()
    return (~w | next_real).all(-1) & w.any(-1)


def _stacked(parts: Sequence[AttributionBatch]) -> AttributionBatch:
    """The rows of ``parts`` one after another (same columns; segments dropped)."""
    cat = (lambda get: torch.cat([get(b) for b in parts]))
    probe = type(parts[0].probe)(*(cat(lambda b, f=f: getattr(b.probe, f.name))
                                   for f in dataclasses.fields(parts[0].probe)))
    return dataclasses.replace(parts[0], input_ids=cat(lambda b: b.input_ids),
                               attention_mask=cat(lambda b: b.attention_mask),
                               position_ids=cat(lambda b: b.position_ids),
                               reasoning_mask=cat(lambda b: b.reasoning_mask), probe=probe, segments=None)


def removal_shifts(backend: AttributionBackend, batch: AttributionBatch, removed: torch.Tensor, src: torch.Tensor,
                   operators: Sequence[Sequence[Variant]], *, logp: bool = False) -> Shifts:
    """Outcome shifts of removing each token set jointly, under each operator, on any backend (module docstring).

    Args:
        backend: the model runtime (its ``align`` makes every data-parallel rank run the same pass count: a rank with
            fewer rows, or rows without removal sets, runs filler passes).
        batch: AttributionBatch (B, L), B >= 1.
        removed: (N, L) bool, the tokens removed from row ``src[i]`` in perturbed row i.
        src: (N,) long source rows.
        operators: O operators, each its D_o >= 1 draws (:func:`~oar_verl.core.fidelity.operators.operator_draws`:
            the Replacement of each draw in ``batch``'s rows, or [None] for ``delete``).
        logp: measure ``logp`` besides ``kl`` (S = 2), else ``kl`` only (S = 1).

    Returns:
        :class:`Shifts`, values (S, O, N): the mean over an operator's draws; NaN for an empty removal set.
    """
    B, L = batch.input_ids.shape
    dev = batch.input_ids.device
    removed, src = removed.to(dev).bool(), src.to(dev)
    entry = removed.any(-1).nonzero().squeeze(1)  # non-empty removal sets only (host sync, once per call)
    sets, of, n = removed[entry], src[entry], int(entry.shape[0])
    draws = [len(v) for v in operators]
    # the expanded batch: the B rows, then per operator its D draws of the n sets (draw-major)
    sources = torch.cat([torch.arange(B, device=dev)] + [of.repeat(d) for d in draws])  # (E,)
    expanded = _stacked([batch] + [deleted_rows(batch, of, sets) if v[0] is None else rows_of(batch, of.repeat(len(v)))
                                   for v in operators])
    joint = expanded.probe.joint
    if logp:  # φ on every row: read as AS-Joint; the kl measure keeps each row's own flag
        expanded = dataclasses.replace(expanded, probe=dataclasses.replace(expanded.probe,
                                                                           joint=torch.ones_like(joint)))
        joint = torch.stack([joint, torch.ones_like(joint)])
    blocks = torch.cat([torch.zeros(B, L, dtype=torch.long, device=dev)]
                       + [sets.long().repeat(d, 1) for d in draws])  # (E, L): 1 at the removed tokens
    first = blocks.argmax(-1)  # a perturbed row's first removed column: its block is exactly the removal set
    ids = None
    if any(r is not None and r.ids is not None for v in operators for r in v):
        ids = expanded.input_ids.clone()  # drawn ids of every expanded row (one tensor for all draws)
    kind, start = PassKind.FORWARD, B
    clean_rows = torch.unique(of)
    own = [Pass(clean_rows[p]) for p in backend.plan(expanded, clean_rows, kind)]
    n_clean = len(own)
    for variants in operators:
        rows = torch.arange(start, start + len(variants) * n, device=dev)
        rep = variants[0]
        if rep is not None and rep.ids is not None:
            for d, r in enumerate(variants):  # per draw, D small
                ids[rows[d * n:(d + 1) * n]] = r.ids[of].to(ids.device)
            rep = dataclasses.replace(rep, ids=ids)
        own += [Pass(rows[p]) if rep is None else Pass(rows[p], first[rows[p]], blocks, rep)
                for p in backend.plan(expanded, rows, kind)]
        start += len(variants) * n
    passes = with_fillers(own, backend.align(len(own)), Pass(first_row(expanded), filler=True), expanded)
    S = 2 if logp else 1
    values = torch.zeros(S, start - B, dtype=torch.float64, device=dev)

    def emit(p: Pass, shift: torch.Tensor) -> None:
        values[:, p.rows.to(dev) - B] = shift.reshape(S, -1).to(dev, torch.float64)

    backend.run(expanded, passes, shift_callback(backend, passes, B, joint, emit, source=sources,
                                                 clean=lambda i, p: i < n_clean))
    values = backend.share(values)  # from the probe-reading ranks (Megatron's last stage) to every rank
    out = torch.full((S, len(operators), removed.shape[0]), float("nan"), dtype=torch.float64, device=dev)
    at = 0
    for o, d in enumerate(draws):  # per operator, O small: the mean over its draws
        out[:, o, entry] = values[:, at:at + d * n].view(S, d, n).mean(1)
        at += d * n
    if logp:
        out[1] = torch.where(logp_defined(batch)[src], out[1], float("nan"))
    return Shifts(out, len(own), start - B)
