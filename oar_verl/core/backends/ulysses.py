"""The attribution backend of a Hugging Face module whose sequences are sharded over a Ulysses sequence-parallel group,
as verl's own forward runs under Ulysses.

Users turn on sequence parallelism when one sequence's activations do not fit a GPU, so attribution must not hold
whole sequences either: a pass's rows (or OAR-P's copies) are packed into one sequence without padding and split into
contiguous shards, one per rank, which the attention all-to-alls. Each rank reads the probe at its own positions and
the group sums the parts; scores are all-gathered. The numbers equal the unsharded backend's; there is no key/value
prefix cache (OAR-P runs the batched copies). The interface: :mod:`oar_verl.core.backends.base`; why the numbers are
exact: docs/verl.md, "The worker RPC" (Ulysses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oar_verl.core.backends.base import DenseProbes, EmbeddingHook, OnProbe, Pass, frozen_parameters
from oar_verl.core.backends.hf import (embedding_mean, embedding_replaced, embedding_row, embedding_scores,
                                     layer_checkpointing)
from oar_verl.core.backends.budget import AttributionMemoryError, PassLimits, pack_lengths
from oar_verl.core.backends.collectives import sum_over_group
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.batch.probes import ProbeOutput

__all__ = ["SequenceShards", "UlyssesBackend"]


@dataclass(frozen=True)
class SequenceShards:
    """A sequence-parallel group: every rank runs the same passes, each holding one shard of their tokens.

    Attributes:
        group: the process group (None: the default group).
        rank: this rank's index in the group.
        size: ranks in the group, >= 1.
    """

    group: object
    rank: int
    size: int


@dataclass(frozen=True)
class _Packed:
    """One pass: rows packed into a sequence, and this rank's shard of it.

    Attributes:
        input_ids / position_ids: (1, n_local) this rank's shard.
        row / col: (n_total,) the batch row and column of every packed position (-1 on the padding).
        slot: (n_total,) which packed row (0..rows-1) every position belongs to (-1 on the padding).
        lo, hi: this rank's shard as [lo, hi) in packed positions.
        replaced: (1, n_local) bool this shard's positions whose embedding output the pass's replacement sets (an
            embedding operator's copies); None otherwise.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    slot: torch.Tensor
    lo: int
    hi: int
    replaced: torch.Tensor | None = None


def _pack(batch: AttributionBatch, p: Pass, shards: SequenceShards, pad_id: int) -> _Packed:
    """Pack the pass's rows (repeats allowed: OAR-P's copies) of ``batch``, with the copies' tokens replaced."""
    rows = p.rows
    real = batch.attention_mask[rows].bool()  # (N, L)
    slot_of, col = real.nonzero().unbind(1)  # row-major: each row's real tokens, in order
    ids = batch.input_ids[rows]
    replaced = p.replaced()
    if replaced is not None:
        ids = p.replacement.input_ids(ids, replaced, rows)
    tokens = ids[slot_of, col]
    # the packed positions whose embedding output an embedding operator replaces
    at_embedding = replaced[slot_of, col] if replaced is not None and p.replacement.embedding else None
    positions = batch.position_ids[rows][slot_of, col]
    n = tokens.shape[0]
    total = -(-n // shards.size) * shards.size
    pad = total - n
    device = tokens.device
    tokens = torch.cat([tokens, torch.full((pad,), pad_id, dtype=tokens.dtype, device=device)])
    positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype, device=device)])  # its own "row"
    minus = torch.full((pad,), -1, dtype=torch.long, device=device)
    row = torch.cat([rows[slot_of], minus])
    slot = torch.cat([slot_of, minus])
    col = torch.cat([col, minus])
    lo, hi = shards.rank * total // shards.size, (shards.rank + 1) * total // shards.size
    if at_embedding is not None:  # this shard's part (the padding is never replaced)
        at_embedding = torch.cat([at_embedding, at_embedding.new_zeros(pad)])[lo:hi][None]
    return _Packed(tokens[lo:hi][None], positions[lo:hi][None], row, col, slot, lo, hi, at_embedding)


def _probe(model: torch.nn.Module, batch: AttributionBatch, packed: _Packed, n_slots: int,
           shards: SequenceShards) -> ProbeOutput:
    """Every packed row's outcome probe, assembled over the group from each rank's own probe positions."""
    row, col, slot = (t[packed.lo:packed.hi] for t in (packed.row, packed.col, packed.slot))
    real = row >= 0
    weight = torch.zeros_like(row, dtype=torch.float32)
    weight[real] = batch.probe.logit_weight[row[real], col[real]].float()
    keep = (weight != 0).nonzero().squeeze(1)  # this rank's probe positions (may be none)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=keep, use_cache=False)
    z = out.logits[0].to(torch.promote_types(out.logits.dtype, torch.float32))  # (K_local, V)
    w, s = weight[keep].to(z.dtype), slot[keep]
    zbar = torch.zeros(n_slots, z.shape[-1], dtype=z.dtype, device=z.device).index_add(0, s, w[:, None] * z)
    slot_rows = _slot_rows(packed, n_slots)
    joint = batch.probe.joint[slot_rows]
    phi = torch.zeros(n_slots, dtype=z.dtype, device=z.device)
    if bool(joint.any()):
        target = batch.probe.target_ids[row[keep], col[keep]]
        tok_logp = torch.log_softmax(z, -1).gather(-1, target[:, None]).squeeze(-1)
        phi = phi.index_add(0, s, w * tok_logp)
    zbar = sum_over_group(zbar, shards.group)
    phi = torch.where(joint, sum_over_group(phi, shards.group), 0.0)
    return ProbeOutput(torch.log_softmax(zbar, -1), phi)


def _slot_rows(packed: _Packed, n_slots: int) -> torch.Tensor:
    """(n_slots,) the batch row of each packed row."""
    real = packed.slot >= 0
    rows = torch.zeros(n_slots, dtype=torch.long, device=packed.slot.device)
    rows[packed.slot[real]] = packed.row[real]
    return rows


class UlyssesBackend(DenseProbes):
    """A Hugging Face module under Ulysses sequence parallelism (see the module docstring).

    Args:
        model: causal LM whose attention handles sequence shards (verl's Ulysses patch), in eval mode.
        limits: the token budget of one pass per rank.
        shards: the sequence-parallel group (every rank of it holds the same batch).
        pad_id: the token filling the last shard.
        checkpointing: checkpoint the decoder layers in backward passes.
        align: maps this rank's pass count to the count every data-parallel rank runs.
    """

    prefix_cache = False
    shared_backwards = True

    def __init__(self, model: torch.nn.Module | None, limits: PassLimits, shards: SequenceShards, *, pad_id: int = 0,
                 checkpointing: bool = True, align: Callable[[int], int] | None = None):
        self.model, self.limits, self.shards = model, limits, shards
        self.pad_id, self.checkpointing = pad_id, checkpointing
        self._align = align

    def plan(self, batch: AttributionBatch, rows: torch.Tensor, kind: str, ordered: bool = False
             ) -> list[torch.Tensor]:
        """Rows (or copies) packed in order so that each rank's shard holds at most the budget."""
        lengths = batch.attention_mask.sum(-1)[rows].tolist()  # host metadata, once per plan
        items = [i for i, n in enumerate(lengths) if n]
        cap = self.limits.copies if ordered else self.limits.rows
        packs = pack_lengths([lengths[i] for i in items], self.limits.tokens * self.shards.size, cap)
        if self.limits.fits is not None and not ordered:
            for p in packs:
                need = -(-sum(lengths[items[j]] for j in p) // self.shards.size)
                if not self.limits.fits(kind, 1, need):
                    raise AttributionMemoryError(f"oar: a pass of {need} tokens per rank does not fit the free memory "
                                                 f"({self.limits.key}={self.limits.tokens})")
        return [torch.tensor([items[j] for j in p], dtype=torch.long, device=rows.device) for p in packs]

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe,
            hook: EmbeddingHook | None = None) -> list[torch.Tensor | None]:
        out = []
        for i, p in enumerate(passes):
            packed = _pack(batch, p, self.shards, self.pad_id)
            if hook is None:
                with torch.no_grad(), embedding_replaced(self.model, p, packed.replaced):
                    on_probe(i, _probe(self.model, batch, packed, len(p.rows), self.shards))
                out.append(None)
                continue
            if packed.replaced is not None:
                raise NotImplementedError("a backward pass over copies whose embedding output is replaced")
            with frozen_parameters(self.model), layer_checkpointing(self.model, self.checkpointing):
                scores = self._scores(batch, p, packed, i, on_probe, hook)  # ([K,] n_total)
            full = scores.new_zeros(p.rows.shape[0], *scores.shape[:-1], batch.input_ids.shape[1])
            real = packed.slot >= 0
            full[packed.slot[real], ..., packed.col[real]] = scores[..., real].movedim(-1, 0)
            out.append(full)
        return out

    def embedding(self, token_id: int) -> torch.Tensor:
        return embedding_row(self.model, token_id)

    def mean_embedding(self) -> torch.Tensor:
        return embedding_mean(self.model)

    def _scores(self, batch: AttributionBatch, p: Pass, packed: _Packed, i: int, on_probe: OnProbe,
                hook: EmbeddingHook) -> torch.Tensor:
        """([K,] n_total) scores of every packed position, the same on every rank of the group."""
        row, col = packed.row[packed.lo:packed.hi], packed.col[packed.lo:packed.hi]
        real = row >= 0
        reasoning = torch.zeros_like(real)
        reasoning[real] = batch.reasoning_mask[row[real], col[real]]
        noise = (None if hook.noise is None
                 else lambda clean: hook.noise(i, *_local_slots(batch, p, packed, reasoning), clean))
        local = embedding_scores(self.model, reasoning[None], noise,
                                 lambda: on_probe(i, _probe(self.model, batch, packed, len(p.rows), self.shards)),
                                 hook)[0]  # ([K,] n_local)
        if self.shards.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.shards.size)]
        dist.all_gather(parts, local.contiguous(), group=self.shards.group)
        return torch.cat(parts, -1)


def _local_slots(batch: AttributionBatch, p: Pass, packed: _Packed, reasoning: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot (m,), rank (m,)) of this shard's m reasoning tokens: their row in the pass and their reasoning rank in
    that row, as unsharded."""
    slot = packed.slot[packed.lo:packed.hi][reasoning]
    col = packed.col[packed.lo:packed.hi][reasoning]
    return slot, batch.reasoning_mask.long().cumsum(-1)[p.rows[slot], col] - 1
