"""One attribution engine: each method plans passes once, each model runtime runs them (docs/method.md §10).

A *method* (OAR-P under every perturbation policy, OAR-G with K noise draws, the second-order ``fisher`` mode) says
which passes to run -- rows of the batch, optionally with tokens swapped for the mask token (OAR-P's copies) or with
seeded noise on the reasoning-token embeddings and a backward (OAR-G's student) -- and what to do with each pass's
outcome probe. A *backend* says where and how: how rows are laid out in a pass and packed under the token budget
(padded rows of a plain Hugging Face module, a packed sequence sharded over a Ulysses group, micro-batches of verl's
Megatron engine), the forward that reads the outcome probe (vocab-parallel where the logits are sharded), the embedding
hook (noise in, gradient × input out), whether copies can reuse a clean key/value prefix, and how data-parallel ranks
agree on a pass count.

The interface, as a method sees it::

    prefix_cache: bool                              copies of one row may reuse its clean key/value prefix
    plan(batch, rows, kind, ordered) -> packs       index packs into ``rows`` (repeats allowed) under the budget
    align(n) -> n'                                  passes every data-parallel rank runs (the max over ranks)
    run(batch, passes, on_probe, noise_std,         run passes in order; on_probe(i, probe) per pass; backward
        project) -> projections                     passes give ⟨∂J/∂e_t, e_t⟩ (or ⟨∂J/∂e_t, e_mask − e_t⟩)
    table(size) -> ProbeTable                       a store of clean probes in this backend's probe form
    shift(clean, probe, joint) -> (b,)              KL(P_clean ‖ P) or φ_clean − φ, in that form
    share(x) -> x                                   a result of the probe-reading ranks, on every rank

A probe handed to ``on_probe`` (:class:`~oar_verl.core.probes.ProbeOutput`, or Megatron's vocab-parallel ``VPProbe``)
offers ``phi``, ``top(k)`` and ``log_prob(ids)``; the methods read it only through those and the backend's ``shift``.

Backends: :class:`oar_verl.core.backend_hf.ModuleBackend`, :class:`oar_verl.core.backend_ulysses.UlyssesBackend`,
``oar_verl.integration.megatron.backend.MegatronBackend``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from oar_verl.core.layout import AttributionBatch
from oar_verl.core.probes import ProbeOutput, outcome_shift


@dataclass(frozen=True)
class Pass:
    """One forward (or noisy forward + backward) over some rows of the batch.

    Attributes:
        rows: (n,) long batch rows, repeats allowed (OAR-P's copies of a row, OAR-G's noise draws).
        first: (n,) long first masked column of each copy (OAR-P), with ``blocks``; None: the clean rows.
        blocks: (B, L) long block layout the copies mask (shared by every pass, never copied per pass).
        seeds: (n,) int64 noise seeds: a forward with seeded noise (σ = the run's ``noise_std``, 0: none) on the
            reasoning-token embeddings whose per-row loss ``on_probe`` returns, then a backward (OAR-G's student);
            None: a no-grad forward.
        cache: "keep": a one-row clean pass whose key/value cache the following "reuse" passes continue (copies of
            that row, recomputing only the columns from their first masked one); None otherwise.
        filler: run only so that every data-parallel rank issues the same collectives; results are dropped.
    """

    rows: torch.Tensor
    first: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    cache: str | None = None
    filler: bool = False

    def replaced(self) -> torch.Tensor | None:
        """(n, L) bool: the tokens each copy swaps for the mask token (those sharing its first column's block)."""
        if self.first is None:
            return None
        blocks = self.blocks[self.rows]
        return blocks == blocks.gather(1, self.first[:, None])


# (pass index, the pass rows' outcome probe) -> the per-row loss (n,) of a noisy pass, None otherwise
OnProbe = Callable[[int, object], "torch.Tensor | None"]


class ProbeTable(Protocol):
    """Per-row clean (teacher) probes, kept between passes."""

    def put(self, rows: torch.Tensor, probe) -> None: ...

    def get(self, rows: torch.Tensor): ...


class AttributionBackend(Protocol):
    """What an attribution method needs from a model runtime (see the module docstring)."""

    prefix_cache: bool

    def plan(self, batch: AttributionBatch, rows: torch.Tensor, kind: str, ordered: bool = False
             ) -> list[torch.Tensor]: ...

    def align(self, n: int) -> int: ...

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe, noise_std: float = 0.0,
            project: str = "input") -> list[torch.Tensor | None]: ...

    def table(self, size: int) -> ProbeTable: ...

    def shift(self, clean, probe, joint: torch.Tensor) -> torch.Tensor: ...

    def share(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseProbeTable:
    """Clean probes of ``size`` rows as dense (size, V) / (size,) tensors (Hugging Face modules, Ulysses)."""

    def __init__(self, size: int):
        self.size = size
        self.logp: torch.Tensor | None = None
        self.phi: torch.Tensor | None = None

    def put(self, rows: torch.Tensor, probe: ProbeOutput) -> None:
        if self.logp is None:
            self.logp = probe.logp.new_zeros(self.size, probe.logp.shape[-1]).detach()
            self.phi = probe.phi.new_zeros(self.size).detach()
        self.logp[rows], self.phi[rows] = probe.logp.detach(), probe.phi.detach()

    def get(self, rows: torch.Tensor) -> ProbeOutput:
        return ProbeOutput(self.logp[rows], self.phi[rows])


class DenseProbes:
    """The members shared by the backends whose every rank reads whole (b, V) probes (a Hugging Face module, plain or
    sequence-sharded): clean probes kept as dense tensors, the shift of :mod:`oar_verl.core.probes`, nothing to share,
    and the rank alignment given at construction (``_align``; None: a single rank's own count)."""

    _align: Callable[[int], int] | None = None

    def align(self, n: int) -> int:
        return n if self._align is None else self._align(n)

    def table(self, size: int) -> DenseProbeTable:
        return DenseProbeTable(size)

    def shift(self, clean: ProbeOutput, probe: ProbeOutput, joint: torch.Tensor) -> torch.Tensor:
        return outcome_shift(clean, probe, joint)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        return x  # every rank read the probe itself


def with_fillers(passes: list[Pass], count: int, filler: Pass, batch: AttributionBatch) -> list[Pass]:
    """``passes`` topped up with ``filler`` (a pass over the first row, results dropped) to ``count``, the passes every
    data-parallel rank runs (the backend's :meth:`~AttributionBackend.align` of the local count)."""
    missing = count - len(passes)
    if missing <= 0:
        return passes
    if batch.input_ids.shape[0] == 0:
        raise ValueError("min_rounds needs at least one local row to repeat (a rank with no rows cannot run the filler "
                         "passes that align it with the other ranks)")
    return passes + [filler] * missing


def first_row(batch: AttributionBatch) -> torch.Tensor:
    """(1,) long: the row filler passes repeat."""
    return torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
