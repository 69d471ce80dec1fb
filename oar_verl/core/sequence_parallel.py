"""Attribution with every sequence sharded over a sequence-parallel group, as verl's own forward runs under Ulysses.

Users turn on sequence parallelism when one sequence's activations do not fit a GPU; attribution must then not hold
whole sequences either. A pass's rows (or OAR-P's masked copies) are packed into one sequence without padding (each
row restarting its position ids, as verl's remove-padding layout does), padded to a multiple of the group size and
split into equal contiguous shards: rank r of the group holds shard r, so a pass holds 1/size of its tokens per rank.
The model's attention all-to-alls the shards and keeps packed rows apart by their position ids (verl's Ulysses patch
of the flash-attention varlen kernel on GPUs); everything else is per token and stays local.

The outcome probe reads positions that may lie on any rank. Each rank reads the logits at its own probe positions
(never the others'), forms its part of every row's weighted sum of raw logits (and of AS-Joint's log-probability
sum), and the group sums the parts; the sum's backward is the identity, so OAR-G's gradient flows once through each
rank's own positions and the attention's all-to-all routes the rest, exactly as for a sequence-parallel loss. Every
rank then holds the whole probe and the same outcome shift. OAR-G's noise for a row is drawn as without sharding (the
k-th reasoning token gets draw k of the row's generator) and each rank adds the draws of its own tokens; the scores
are all-gathered over the group. With K noise draws, a row's K draw rows are packed like rows (each as long as its
row, each with its own seed), the teacher runs once per distinct row of a pass, and the K scores are averaged. The
numbers equal the unsharded method's (tested on 2 gloo ranks).

OAR-P runs the batched masked copies (a key/value prefix cache does not shard); copies are packed like rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from oar_verl.core.budget import PassLimits
from oar_verl.core.gradient import draw_seeds, frozen_parameters, layer_checkpointing
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.memory import PassKind
from oar_verl.core.perturbation import copy_masks, masked_copies
from oar_verl.core.probes import ProbeOutput, outcome_shift

__all__ = ["SequenceShards", "collective_rounds_sharded", "oar_g_importance_sharded", "oar_p_importance_sharded"]


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


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the group; backward is the identity (each rank's gradient is its own share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass(frozen=True)
class _Packed:
    """One pass: rows packed into a sequence, and this rank's shard of it.

    Attributes:
        input_ids / position_ids: (1, n_local) this rank's shard.
        row / col: (n_total,) the batch row and column of every packed position (-1 on the padding).
        slot: (n_total,) which packed row (0..rows-1) every position belongs to (-1 on the padding).
        lo, hi: this rank's shard as [lo, hi) in packed positions.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    slot: torch.Tensor
    lo: int
    hi: int


def _pack(batch: AttributionBatch, rows: torch.Tensor, shards: SequenceShards, pad_id: int,
          masked: torch.Tensor | None = None, mask_token_id: int = 0) -> _Packed:
    """Pack ``rows`` (repeats allowed: OAR-P's copies) of ``batch``; ``masked`` (N, L) replaces tokens per row."""
    real = batch.attention_mask[rows].bool()  # (N, L)
    slot_of, col = real.nonzero().unbind(1)  # row-major: each row's real tokens, in order
    ids = batch.input_ids[rows]
    if masked is not None:
        ids = ids.masked_fill(masked, mask_token_id)
    tokens = ids[slot_of, col]
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
    return _Packed(tokens[lo:hi][None], positions[lo:hi][None], row, col, slot, lo, hi)


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
    zbar = _SumOverGroup.apply(zbar, shards.group)
    phi = torch.where(joint, _SumOverGroup.apply(phi, shards.group), 0.0)
    return ProbeOutput(torch.log_softmax(zbar, -1), phi)


def _slot_rows(packed: _Packed, n_slots: int) -> torch.Tensor:
    """(n_slots,) the batch row of each packed row."""
    real = packed.slot >= 0
    rows = torch.zeros(n_slots, dtype=torch.long, device=packed.slot.device)
    rows[packed.slot[real]] = packed.row[real]
    return rows


def _pack_sizes(lengths: list[int], tokens: int) -> list[list[int]]:
    """Greedy packs of item indices, in order, whose total length fits ``tokens`` (an item over it alone)."""
    packs, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > tokens:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def _row_packs(batch: AttributionBatch, limits: PassLimits, shards: SequenceShards, kind: str,
               samples: int = 1) -> list[torch.Tensor]:
    """Draw rows e = b·K + k (row b under OAR-G noise draw k; K = ``samples``, 1: the rows themselves) packed so that
    each rank's shard holds at most the budget (a pass holds the sum of its rows' tokens)."""
    lengths = batch.attention_mask.sum(-1).repeat_interleave(samples).tolist()  # host metadata, once per batch
    rows = [b for b, n in enumerate(lengths) if n]
    cap = limits.rows or len(rows) or 1
    packs = []
    for group in _pack_sizes([lengths[b] for b in rows], limits.tokens * shards.size):
        for s in range(0, len(group), cap):
            packs.append(torch.tensor([rows[i] for i in group[s:s + cap]], device=batch.input_ids.device))
    if limits.fits is not None:
        for p in packs:
            need = -(-sum(lengths[b] for b in p.tolist()) // shards.size)
            if not limits.fits(kind, 1, need):
                from oar_verl.core.budget import AttributionMemoryError

                raise AttributionMemoryError(f"oar: a pass of {need} tokens per rank does not fit the free memory "
                                             f"({limits.key}={limits.tokens})")
    return packs


def _copy_packs(batch: AttributionBatch, src: torch.Tensor, limits: PassLimits,
                shards: SequenceShards) -> list[tuple[int, int]]:
    """OAR-P's copies (each as long as its row), in order, packed under the budget times the group size."""
    lengths = batch.attention_mask.sum(-1)[src].tolist()
    packs = []
    for group in _pack_sizes(lengths, limits.tokens * shards.size):
        cap = limits.copies or len(group)
        for s in range(0, len(group), cap):
            part = group[s:s + cap]
            packs.append((part[0], part[-1] + 1))
    return packs


def collective_rounds_sharded(batch: AttributionBatch, mode: str, limits: PassLimits, shards: SequenceShards,
                              mask_span: int = 1, blocks: torch.Tensor | None = None, samples: int = 1) -> int:
    """Passes the sharded method runs on ``batch`` (OAR-G with ``samples`` noise draws per row: a teacher and a
    student forward per round count as one)."""
    if mode == "gradient":
        return len(_row_packs(batch, limits, shards, PassKind.INPUT_GRADIENT, samples))
    clean = len(_row_packs(batch, limits, shards, PassKind.FORWARD))
    src, _, _ = masked_copies(batch.reasoning_mask, mask_span, blocks)
    return clean + len(_copy_packs(batch, src, limits, shards))


def _clean_probes(model, batch: AttributionBatch, limits: PassLimits, shards: SequenceShards,
                  pad_id: int) -> tuple[ProbeOutput | None, int]:
    """(B, V) / (B,) clean probes of every row, and the passes run."""
    packs = _row_packs(batch, limits, shards, PassKind.FORWARD)
    logp = phi = None
    for rows in packs:
        with torch.no_grad():
            out = _probe(model, batch, _pack(batch, rows, shards, pad_id), len(rows), shards)
        if logp is None:
            logp = out.logp.new_zeros(batch.input_ids.shape[0], out.logp.shape[-1])
            phi = out.phi.new_zeros(batch.input_ids.shape[0])
        logp[rows], phi[rows] = out.logp, out.phi
    return (None if logp is None else ProbeOutput(logp, phi)), len(packs)


def _filler(model, batch: AttributionBatch, shards: SequenceShards, pad_id: int, n: int) -> None:
    """Run ``n`` discarded passes of row 0, so that every data-parallel rank issues the same collectives."""
    if n > 0 and batch.input_ids.shape[0] == 0:
        raise ValueError("min_rounds needs at least one local row to repeat")
    first = torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
    for _ in range(n):
        with torch.no_grad():
            _probe(model, batch, _pack(batch, first, shards, pad_id), 1, shards)


@torch.no_grad()
def oar_p_importance_sharded(model: torch.nn.Module, batch: AttributionBatch, mask_token_id: int, limits: PassLimits,
                             shards: SequenceShards, pad_id: int = 0, min_rounds: int = 0,
                             mask_span: int = 1, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """OAR-P with sharded sequences (see the module docstring); the same numbers as
    :func:`oar_verl.core.perturbation.oar_p_importance`, on every rank of the group.

    Args:
        model: causal LM whose attention handles sequence shards (verl's Ulysses patch), in eval mode.
        batch: AttributionBatch (B, L), the same on every rank of the group.
        mask_token_id: OAR-P's replacement token.
        limits: the token budget of one pass per rank.
        shards: the sequence-parallel group.
        pad_id: token filling the last shard.
        min_rounds: passes to run at least (data-parallel ranks align on the max of
            :func:`collective_rounds_sharded`).
        mask_span: reasoning tokens masked together per copy.
        blocks: (B, L) long explicit block layout, one copy per block (overrides ``mask_span``; see
            :func:`oar_verl.core.perturbation.block_copies`).

    Returns:
        (B, L) float32 importance at reasoning positions, 0 elsewhere.
    """
    clean, ran = _clean_probes(model, batch, limits, shards, pad_id)
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    src, first, blocks = masked_copies(batch.reasoning_mask, mask_span, blocks)
    for s, e in _copy_packs(batch, src, limits, shards):
        rows = src[s:e]
        masked = copy_masks(blocks[rows], first[s:e])  # (c, L)
        packed = _pack(batch, rows, shards, pad_id, masked, mask_token_id)
        pert = _probe(model, batch, packed, len(rows), shards)
        shift = outcome_shift(clean.index(rows), pert, batch.probe.joint[rows]).float()
        r, j = masked.nonzero().unbind(1)
        importance[rows[r], j] = shift[r]
        ran += 1
    _filler(model, batch, shards, pad_id, min_rounds - ran)
    return importance


def oar_g_importance_sharded(model: torch.nn.Module, batch: AttributionBatch, noise_std: float, seeds: torch.Tensor,
                             limits: PassLimits, shards: SequenceShards, pad_id: int = 0, min_rounds: int = 0,
                             checkpointing: bool = False, samples: int = 1) -> torch.Tensor:
    """OAR-G with sharded sequences (see the module docstring); the same numbers as
    :func:`oar_verl.core.gradient.oar_g_importance`, on every rank of the group.

    Args:
        model: causal LM whose attention handles sequence shards, with ``get_input_embeddings()``, in eval mode.
        batch: AttributionBatch (B, L), the same on every rank of the group.
        noise_std: σ of the embedding noise.
        seeds: (B,) per-sequence seeds (draw k of row b: ``draw_seeds(seeds, samples)[b, k]``).
        limits: the token budget of one round per rank (it bounds the draw rows of a round).
        shards: the sequence-parallel group.
        pad_id: token filling the last shard.
        min_rounds: rounds to run at least (data-parallel ranks align on the max).
        checkpointing: checkpoint the decoder layers in the student pass.
        samples: K >= 1 noise draws per row, averaged (``algorithm.oar.noise_samples``).

    Returns:
        (B, L) float32 mean over the K draws of |⟨∂J/∂e_t, e_t⟩| at reasoning positions, 0 elsewhere.
    """
    B, L = batch.input_ids.shape
    per_draw = torch.zeros(B * samples, L, dtype=torch.float32, device=batch.input_ids.device)  # e = b·K + k
    packs = _row_packs(batch, limits, shards, PassKind.INPUT_GRADIENT, samples)
    draw_seed = draw_seeds(seeds, samples).reshape(-1)  # (B·K,)
    first = torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
    if min_rounds > len(packs) and B == 0:
        raise ValueError("min_rounds needs at least one local row to repeat")
    with frozen_parameters(model), layer_checkpointing(model, checkpointing):
        for r in range(max(len(packs), min_rounds)):
            draws = packs[r] if r < len(packs) else first
            rows = draws // samples
            packed = _pack(batch, rows, shards, pad_id)
            sal = _saliency_round(model, batch, rows, packed, noise_std, draw_seed[draws], shards, pad_id)
            if r < len(packs):
                real = packed.slot >= 0
                per_draw[draws[packed.slot[real]], packed.col[real]] = sal[real]
    return per_draw.view(B, samples, L).mean(1)


def _saliency_round(model, batch: AttributionBatch, rows: torch.Tensor, packed: _Packed, noise_std: float,
                    slot_seeds: torch.Tensor, shards: SequenceShards, pad_id: int) -> torch.Tensor:
    """(n_total,) saliency of every packed position (0 off reasoning), the same on every rank of the group.

    ``rows`` (n,) sorted, repeats allowed (a row's noise draws), packed as ``packed``; ``slot_seeds`` (n,) the noise
    seed of each packed row. The teacher pass packs the distinct rows only."""
    distinct, of_slot = torch.unique_consecutive(rows, return_inverse=True)
    with torch.no_grad():
        teacher = _probe(model, batch, _pack(batch, distinct, shards, pad_id), len(distinct), shards).index(of_slot)
    row, col = packed.row[packed.lo:packed.hi], packed.col[packed.lo:packed.hi]
    real = row >= 0
    reasoning = torch.zeros_like(real)
    reasoning[real] = batch.reasoning_mask[row[real], col[real]]
    captured: dict[str, torch.Tensor] = {}

    def add_noise(module, args, out):
        clean = out.detach()
        leaf = clean.clone()
        noise = _local_noise(batch, rows, packed, reasoning, clean.shape[-1], noise_std, slot_seeds)
        leaf[0, reasoning] += noise.to(clean.dtype)
        leaf.requires_grad_(True)
        captured["clean"], captured["leaf"] = clean, leaf
        return leaf

    handle = model.get_input_embeddings().register_forward_hook(add_noise)
    try:
        with torch.enable_grad():
            student = _probe(model, batch, packed, len(rows), shards)
            J = outcome_shift(teacher, student, batch.probe.joint[_slot_rows(packed, len(rows))]).sum()
            J.backward()
    finally:
        handle.remove()
    leaf, clean = captured["leaf"], captured["clean"]
    acc = torch.promote_types(clean.dtype, torch.float32)
    local = (leaf.grad[0].to(acc) * clean[0].to(acc)).sum(-1).abs().float()
    local = torch.where(reasoning, local, 0.0)
    if shards.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(shards.size)]
    dist.all_gather(parts, local.contiguous(), group=shards.group)
    return torch.cat(parts)


def _local_noise(batch: AttributionBatch, rows: torch.Tensor, packed: _Packed, reasoning: torch.Tensor, hidden: int,
                 noise_std: float, slot_seeds: torch.Tensor) -> torch.Tensor:
    """(n, H) float32 noise of this shard's n reasoning tokens: the very draws they get unsharded.

    Each packed row's generator (seeded with its ``slot_seeds`` entry) draws the row's whole (R, H) block, as
    :func:`oar_verl.core.gradient.reasoning_noise` does (a shorter draw is not a prefix of a longer one on every
    device), and the shard keeps its tokens' rows of it.
    """
    slot = packed.slot[packed.lo:packed.hi][reasoning]
    col = packed.col[packed.lo:packed.hi][reasoning]
    device = batch.input_ids.device
    if slot.numel() == 0:
        return torch.zeros(0, hidden, device=device)
    ranks = batch.reasoning_mask.long().cumsum(-1)
    counts = ranks[:, -1]
    out = []
    for s in slot.unique_consecutive().tolist():  # per packed row, never per token
        b = int(rows[s])
        gen = torch.Generator(device=device).manual_seed(int(slot_seeds[s]))
        draws = torch.randn(int(counts[b]), hidden, generator=gen, device=device)
        out.append(draws[ranks[b, col[slot == s]] - 1])
    return torch.cat(out) * noise_std
