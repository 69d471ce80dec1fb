"""The interface every attribution method is written on (docs/method.md §10): methods plan passes and own their maths,
backends run passes.

A *method* (OAR-P under every policy, OAR-G, ``fisher``, ``path``) says which passes to run (rows, optionally with
tokens replaced: OAR-P's copies), what to do with each pass's outcome probe and, for gradient methods, what happens
at the input-embedding output (:class:`EmbeddingHook`). A *backend* (``hf.ModuleBackend``, ``ulysses.UlyssesBackend``,
``integration.megatron.backend.MegatronBackend``) lays rows out under the token budget, runs the forward that reads
the probe and keeps data-parallel ranks in step; it never sees a method setting. The members of
:class:`AttributionBackend`, with their meaning and shapes: docs/method.md §10.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.batch.probes import ProbeOutput, outcome_shift


@dataclass(frozen=True, eq=False)
class Replacement:
    """What replaces a copy's masked tokens (``algorithm.oar.mask``, :mod:`oar_verl.core.methods.mask_operator`), built once per
    batch. Exactly one of:

    Attributes:
        token: one token id for every replaced position (``pad``, ``token``): ``input_ids`` change.
        ids: (B, L) long per-position replacement ids in batch columns (``resample``): ``input_ids`` change.
        vector: (H,) the input-embedding output of every replaced position (``zero``, ``mean``), with ``embedding``;
            None on ranks that hold no embedding (Megatron's later pipeline stages).
        embedding: the embedding output is replaced (a forward hook on the input embedding), not the ids.
    """

    token: int | None = None
    ids: torch.Tensor | None = None
    vector: torch.Tensor | None = None
    embedding: bool = False

    def input_ids(self, ids: torch.Tensor, replaced: torch.Tensor, rows: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """(n, s) ``ids`` (n, s) of batch ``rows`` (n,) in columns [lo, lo + s) with the ``replaced`` (n, s) positions
        swapped for the replacement token; unchanged for an embedding operator (its hook does the swap)."""
        if self.embedding:
            return ids
        if self.ids is not None:
            return torch.where(replaced, self.ids[rows][:, lo:lo + ids.shape[1]].to(ids.device), ids)
        return ids.masked_fill(replaced, self.token)

    def at_embedding(self, out: torch.Tensor, replaced: torch.Tensor) -> torch.Tensor:
        """(..., H) embedding output ``out`` with the ``replaced`` (...) bool positions set to the vector."""
        return torch.where(replaced.to(out.device)[..., None], self.vector.to(out.device, out.dtype), out)


@dataclass(frozen=True)
class Pass:
    """One forward (or, under an :class:`EmbeddingHook`, forward + backward) over some rows of the batch.

    Attributes:
        rows: (n,) long batch rows, repeats allowed (OAR-P's copies of a row, a gradient method's draws).
        first: (n,) long first replaced column of each copy (OAR-P), with ``blocks``; None: the clean rows.
        blocks: (B, L) long block layout the copies replace (shared by every pass, never copied per pass).
        replacement: what replaces the tokens of a copy's block (with ``first``).
        cache: "keep": a one-row clean pass whose key/value cache the following "reuse" passes continue (copies of
            that row, recomputing only the columns from their first replaced one); None otherwise.
        filler: run only so that every data-parallel rank issues the same collectives; results are dropped.
    """

    rows: torch.Tensor
    first: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    replacement: Replacement | None = None
    cache: str | None = None
    filler: bool = False

    def replaced(self) -> torch.Tensor | None:
        """(n, L) bool: the tokens each copy replaces (those sharing its first column's block)."""
        if self.first is None:
            return None
        blocks = self.blocks[self.rows]
        return blocks == blocks.gather(1, self.first[:, None])


# (pass index, the pass rows' outcome probe) -> the per-row loss (n,) or (n, K) of a backward pass, None otherwise
OnProbe = Callable[[int, object], "torch.Tensor | None"]


@dataclass(frozen=True)
class EmbeddingHook:
    """What a gradient method does at the input-embedding output of its backward passes.

    The backend returns the embedding output as a detached leaf (the only tensor that requires grad, parameters
    frozen), with ``noise`` added at the rows' reasoning tokens, runs the forward whose per-row loss ``on_probe``
    returns, and reads each token's score from the leaf's gradient with ``project``.

    Attributes:
        project: (grad (b, s, H), clean (b, s, H)) -> (b, s) float32 score of every position from the embedding
            gradient and the clean embedding output (e.g. gradient × input).
        noise: (pass index i, slot (m,), rank (m,), clean (m, H)) -> (m, H) the displacement added to the embedding
            output of pass i's m reasoning tokens (OAR-G's seeded noise; ``path``'s move α(e_mask − e_t)); ``slot``
            is a token's row within the pass, ``rank`` its rank among that row's reasoning tokens, ``clean`` their
            clean embedding outputs, so a displacement depends on a token's row, rank and embedding only, never on
            layout, padding or sharding. float32, or the clean dtype where wider. None: no displacement.
        outputs: K >= 1 losses per row: ``on_probe`` returns (n, K), and one forward serves K backwards, one
            projection each; the backend then returns (n, K, L) per pass.
    """

    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    noise: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    outputs: int = 1


class ProbeTable(Protocol):
    """Per-row clean (teacher) probes, kept between passes."""

    def put(self, rows: torch.Tensor, probe) -> None: ...

    def get(self, rows: torch.Tensor): ...


class AttributionBackend(Protocol):
    """What an attribution method needs from a model runtime (see the module docstring)."""

    prefix_cache: bool
    shared_backwards: bool

    def plan(self, batch: AttributionBatch, rows: torch.Tensor, kind: str, ordered: bool = False
             ) -> list[torch.Tensor]: ...

    def align(self, n: int) -> int: ...

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe,
            hook: EmbeddingHook | None = None) -> list[torch.Tensor | None]: ...

    def embedding(self, token_id: int) -> torch.Tensor | None: ...

    def mean_embedding(self) -> torch.Tensor | None: ...

    def table(self, size: int) -> ProbeTable: ...

    def shift(self, clean, probe, joint: torch.Tensor) -> torch.Tensor: ...

    def share(self, x: torch.Tensor) -> torch.Tensor: ...

    def propagation_rules(self, attention_rule: str) -> contextlib.AbstractContextManager: ...


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
    sequence-sharded): clean probes kept as dense tensors, the shift of :mod:`oar_verl.core.batch.probes`, nothing to share,
    the rank alignment given at construction (``_align``; None: a single rank's own count), and the conservative
    propagation rules of the module (``self.model``; under Ulysses the wrapped attention is the sequence-parallel one)."""

    _align: Callable[[int], int] | None = None

    def align(self, n: int) -> int:
        return n if self._align is None else self._align(n)

    def table(self, size: int) -> DenseProbeTable:
        return DenseProbeTable(size)

    def shift(self, clean: ProbeOutput, probe: ProbeOutput, joint: torch.Tensor) -> torch.Tensor:
        return outcome_shift(clean, probe, joint)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        return x  # every rank read the probe itself

    def propagation_rules(self, attention_rule: str) -> contextlib.AbstractContextManager:
        from oar_verl.core.backends.rules import conservative_rules

        return conservative_rules(self.model, attention_rule)


def with_fillers(passes: list[Pass], count: int, filler: Pass, batch: AttributionBatch) -> list[Pass]:
    """``passes`` topped up with ``filler`` (a pass over the first row, results dropped) to ``count``, the passes every
    data-parallel rank runs (the backend's :meth:`~AttributionBackend.align` of the local count)."""
    missing = count - len(passes)
    if missing <= 0:
        return passes
    if batch.input_ids.shape[0] == 0:
        raise ValueError("a rank with no rows cannot run the filler passes that align it with the other ranks")
    return passes + [filler] * missing


def first_row(batch: AttributionBatch) -> torch.Tensor:
    """(1,) long: the row filler passes repeat."""
    return torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)


def shift_callback(backend: AttributionBackend, passes: Sequence[Pass], size: int, joint: torch.Tensor,
                   emit: Callable[[Pass, torch.Tensor], None], *, source: torch.Tensor | None = None,
                   clean: Callable[[int, Pass], bool] | None = None) -> OnProbe:
    """The ``on_probe`` of a method that compares perturbed rows with clean ones (OAR-P's masked copies, the fidelity
    metric's removals): a clean pass keeps its rows' probes in a table of the backend's form, every other pass's
    probes are read against their rows' clean probes with ``backend.shift``, filler passes are skipped.

    Args:
        backend: the runtime (its ``table`` and ``shift``).
        passes: the passes ``backend.run`` runs, fillers included.
        size: rows of the table of clean probes.
        joint: (N,) bool per batch row: read φ_clean − φ instead of KL (the probe's ``joint``); or (S, N): S shifts
            per row, one per flag row (the fidelity metric's measures).
        emit: (pass, shift (n,) or (S, n) of the pass's rows) -> None.
        source: (N,) long the table row of every batch row (default: the row itself).
        clean: (pass index, pass) -> whether the pass is a clean one (default: it replaces nothing, ``first`` is None).
    """
    table = backend.table(size)
    key = (lambda rows: rows) if source is None else (lambda rows: source[rows.to(source.device)])

    def on_probe(i: int, probe) -> None:
        p = passes[i]
        if p.filler:
            return
        if p.first is None if clean is None else clean(i, p):
            table.put(key(p.rows), probe)
            return
        ref, flags = table.get(key(p.rows)), joint[..., p.rows.to(joint.device)]
        emit(p, backend.shift(ref, probe, flags) if flags.dim() == 1
             else torch.stack([backend.shift(ref, probe, f) for f in flags]))  # S <= 2 measures, never per token

    return on_probe


def plan_draws(backend: AttributionBackend, batch: AttributionBatch, draws: int, kind: str
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """K draws per row, packed: draw row e = b·K + k is draw k of row b (a noise draw, an outcome).

    Returns:
        (draw_rows (B·K,) long: the batch row of each draw row, packs: index packs into the draw rows). A row's K
        draws share a pass while the budget allows and spread over more passes when not.
    """
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device).repeat_interleave(draws)
    return rows, backend.plan(batch, rows, kind)


def collect(scores: Sequence[torch.Tensor], packs: Sequence[torch.Tensor], shape: tuple[int, ...],
            device: torch.device) -> torch.Tensor:
    """(N, ..., L) = ``shape`` float32 per-row scores from per-pass results: pass j's (n_j, ..., L) go to rows
    ``packs[j]`` (results beyond the packs, the filler passes', are dropped); rows no pass covered stay 0."""
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    for pack, s in zip(packs, scores):  # per pass
        out[pack.to(device)] = s.to(device, torch.float32)
    return out


def reasoning_slots(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot (m,), rank (m,)) of the m positions of a (b, s) mask whose rows hold their whole reasoning, row-major:
    each position's row and its rank among its row's reasoning positions (what :attr:`EmbeddingHook.noise` takes)."""
    slot, col = mask.nonzero().unbind(1)
    return slot, (mask.long().cumsum(-1) - 1)[slot, col]


@contextlib.contextmanager
def frozen_parameters(params: torch.nn.Module | Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Set requires_grad=False on every parameter (of a module, or given) for the duration; restore the flags after.
    A module is the whole model (an FSDP2 one, its root: initialised first, :func:`fsdp_initialised`)."""
    if isinstance(params, torch.nn.Module):
        fsdp_initialised(params)
    params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def fsdp_initialised(module: torch.nn.Module) -> None:
    """Run FSDP2's lazy initialisation of a root ``fully_shard`` module now, a no-op for any other module or once done.

    FSDP2 fixes each parameter group's gradient dtypes at the root's first forward from the ``requires_grad`` flags it
    finds then: a first forward with every parameter frozen (attribution reading verl's old-log-prob pass at a run's
    first step or after a resume, or bypass mode's own passes) would leave the actor's later gradients in the compute
    dtype (bf16) where its parameters are fp32, and the update fails."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    if isinstance(module, FSDPModule):
        module._get_fsdp_state()._lazy_init()
