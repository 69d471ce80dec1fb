"""Attribution read from a forward that runs anyway: verl's old-log-prob pass (docs/method.md §14).

A clean-point gradient method (``fisher``, ``conservative``) needs one forward of the clean rows and backwards from
the outcome probe to the input embeddings. verl's old-log-prob pass is that forward, over the same rows with the same
weights. Inside :meth:`SharedAttribution.forward` a forward of the model computes exactly what it computes outside
(the logits keep their values, so every log-prob the caller reads is the same number), while

* the input embedding's output is a detached leaf that requires grad (the only one: parameters frozen),
* the logits of the probe positions (:func:`probe_index`) are kept with their graph, and
* on the way out the probe is read from them, the method's losses (:class:`SharedTarget`) are back-propagated to the
  leaf, one backward per loss column, and each token's projection is stored by its batch row and column
  (:class:`ForwardLayout`). The backward goes through the LM head's output like any backward (a sharding wrapper
  regathers the head's weight as usual), so it holds one (tokens, V) gradient of the logits in the model's dtype at
  its peak, as the training step does.

The forward may be laid out as the caller likes (verl's packed rows, padded rows in a column window): a
:class:`ForwardLayout` says where each flat token of it sits in the :class:`~oar_verl.core.batch.layout.
AttributionBatch`. Under Ulysses sequence parallelism (``shards``) the model sees one contiguous shard of the packed
forward per rank (verl pads the packed tokens to a multiple of the group and slices them): each rank reads the probe's
partial sums at its own positions, the group sums them (differentiably: every rank back-propagates the same losses
through the attention's all-to-alls) and each rank stores the projections of its own positions; ``result`` sums the
ranks' parts. ``recompute`` chooses per forward which share of the decoder layers keep only their inputs (their
backward recomputes them: about two forwards) while the others keep their activations (about one).

OAR-G differentiates at noisy points, so only its clean teacher can come from such a forward:
:class:`SharedTeacher` reads each row's probe from the head's output and keeps it for the method's noisy passes,
leaving the forward untouched (no grad, no backward).

Both readers count the seconds of their own work (:attr:`SharedAttribution.seconds`, :attr:`SharedTeacher.seconds`:
the backwards, the probe reads), not the forward they read from, with the accelerator synchronised at each timed
segment's ends (:class:`Stopwatch`): a caller inside a pass that runs anyway (verl's old-log-prob call, OpenRLHF's
experience maker) reports them as attribution's cost there.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oar_verl.core.backends.base import DenseProbeTable, frozen_parameters
from oar_verl.core.backends.collectives import any_over_ranks, sum_over_group
from oar_verl.core.backends.families import Transform, model_config, post_head_transform
from oar_verl.core.backends.hf import layer_checkpointing
from oar_verl.core.backends.ulysses import SequenceShards
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.batch.probes import ProbeOutput, probe_from_logits


def synchronize() -> None:
    """Wait until the current accelerator has run the work queued on it (nothing to wait for without one)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        accelerator.synchronize()


class Stopwatch:
    """Seconds spent in timed blocks, summed: ``with clock(): ...``. Each block synchronises the accelerator at its
    start and at its end, so the seconds are the block's device work, not the queue it found or left (two waits per
    block: time segments, never per-token steps)."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        synchronize()
        start = time.perf_counter()
        yield
        synchronize()
        self.seconds += time.perf_counter() - start


@dataclass(frozen=True)
class SharedTarget:
    """What a clean-point gradient method reads from a shared forward.

    Attributes:
        batch: the batch whose probe is read (``conservative``: every probe as φ).
        columns: C >= 1 losses per row, one backward each from the one forward.
        losses: (probe of n rows, their batch rows (n,)) -> (losses (n, C), weights (n, C) float32 detached).
        project: (grad (b, s, H), clean (b, s, H)) -> (b, s) float32 projection of every position.
        finish: (projections (B, C, L) float32, weights (B, C)) -> (B, L) float32 scores.
        rules: the backward runs under the model's conservative propagation rules with this attention rule
            (``algorithm.oar.attention_rule``); None: no rules.
    """

    batch: AttributionBatch
    columns: int
    losses: Callable[[ProbeOutput, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rules: str | None = None


@dataclass(frozen=True)
class ForwardLayout:
    """Where the tokens of one forward sit in the batch: flat token j of the forward's (b·s) positions is
    ``flat[j]``, of batch row ``row[j]`` in column ``col[j]``; ``slot[j]`` is its sequence within the forward.

    Attributes:
        rows: (n,) long the batch row of each sequence of the forward.
        flat, slot, row, col: (m,) long per real token.
    """

    rows: torch.Tensor
    flat: torch.Tensor
    slot: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor

    @classmethod
    def sequences(cls, rows: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                  width: int | None = None) -> ForwardLayout:
        """Whole sequences, each beginning at batch column ``starts[i]``: packed end to end in one (1, total) row
        (``width`` None: verl's remove-padding layout), or one (n, width) row each, right-padded (verl's padded
        layout).

        Args:
            rows: (n,) long batch rows. lengths: (n,) long tokens of each sequence. starts: (n,) long first column.
            width: the padded rows' width (>= every length), or None.
        """
        slot = torch.arange(rows.shape[0], device=rows.device).repeat_interleave(lengths)
        first = lengths.cumsum(0) - lengths  # each sequence's first token among all real tokens
        j = torch.arange(slot.shape[0], device=rows.device) - first[slot]  # position within the sequence
        flat = (first[slot] if width is None else slot * width) + j
        return cls(rows, flat, slot, rows[slot], starts[slot] + j)

    @classmethod
    def padded(cls, rows: torch.Tensor, attention_mask: torch.Tensor, lo: int) -> ForwardLayout:
        """Padded rows (n, s) of batch columns [lo, lo + s), real where ``attention_mask`` (n, s) is set."""
        slot, c = attention_mask.bool().nonzero().unbind(1)
        return cls(rows, slot * attention_mask.shape[1] + c, slot, rows[slot], c + lo)


def probe_index(layout: ForwardLayout, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe positions of every sequence of a forward, padded to the widest: (index (n, K) long into the flat
    positions, its (batch row, column) pairs' weights (n, K); padding: index 0, weight 0).

    Args:
        layout: the forward's layout. weight: (B, L) the probe's logit weights (``ProbeSpec.logit_weight``).
    """
    w = weight[layout.row, layout.col]
    kept = w != 0
    slot = layout.slot[kept]
    n = layout.rows.shape[0]
    counts = torch.bincount(slot, minlength=n)
    rank = torch.arange(slot.shape[0], device=slot.device) - (counts.cumsum(0) - counts)[slot]
    width = max(int(counts.max()) if n else 0, 1)
    index = torch.zeros(n, width, dtype=torch.long, device=slot.device)
    weights = torch.zeros(n, width, dtype=weight.dtype, device=slot.device)
    index[slot, rank] = layout.flat[kept]
    weights[slot, rank] = w[kept]
    return index, weights


class SharedAttribution:
    """A clean-point gradient method's scores gathered over the forwards run inside :meth:`forward`.

    Args:
        model: the Hugging Face causal LM (or its FSDP wrapper) the caller runs.
        target: the method's :class:`SharedTarget`.
        recompute: (tokens of a forward) -> the share of the decoder layers its backward recomputes (gradient
            checkpointing; the others keep their activations)
            (:func:`~oar_verl.core.backends.memory.recompute_policy`), or one setting for every forward (a bool:
            under Ulysses the ranks must agree where the recompute runs collectives).
        shards: the Ulysses sequence-parallel group the forwards are sharded over (every rank of it runs the same
            forwards), or None.
    """

    def __init__(self, model: torch.nn.Module, target: SharedTarget, recompute: Callable[[int], float] | bool,
                 shards: SequenceShards | None = None):
        if isinstance(recompute, bool):
            recompute = functools.partial(_always, float(recompute))
        self.model, self.target, self.recompute = model, target, recompute
        self.shards = shards if shards is not None and shards.size > 1 else None
        B, L = target.batch.input_ids.shape
        device = target.batch.input_ids.device
        self.projections = torch.zeros(B, target.columns, L, dtype=torch.float32, device=device)
        self.weights = torch.zeros(B, target.columns, dtype=torch.float32, device=device)
        self.covered = torch.zeros(B, dtype=torch.bool, device=device)
        self.choices: list[tuple[int, float]] = []  # (tokens, share of layers recomputed) per forward, for the log
        self.clock = Stopwatch()  # the backwards' seconds (the forwards are the caller's)
        # the model's own soft-cap / scaling (or None), by the identity rule under the conservative rules
        self.transform = post_head_transform(model_config(model))
        if self.transform is not None and target.rules is not None:
            from oar_verl.core.backends.rules import linear_rule

            self.transform = functools.partial(linear_rule, self.transform)

    @contextlib.contextmanager
    def forward(self, layout: ForwardLayout) -> Iterator[None]:
        """Run the model's forward(s) of ``layout``'s rows inside: they are attributed on the way out. The model's
        forward runs with grad on (a caller's ``no_grad`` is lifted for it alone), so its logits carry the graph until
        the block ends; their values are the plain forward's (read them without grad, as verl does)."""
        tokens = int(layout.flat.shape[0])
        recompute = float(self.recompute(tokens))
        self.choices.append((tokens, recompute))
        index, weights = probe_index(layout, self.target.batch.probe.logit_weight)
        captured: dict[str, torch.Tensor] = {}
        modes: list[bool] = []

        def enter(module, args):
            modes.append(torch.is_grad_enabled())
            torch.set_grad_enabled(True)

        def leave(module, args, out):
            torch.set_grad_enabled(modes.pop())

        def at_embedding(module, args, out):
            clean = out.detach()
            leaf = clean.clone().requires_grad_(True)
            captured["clean"], captured["leaf"] = clean, leaf
            captured["lo"] = shard_start(self.shards, out, tokens)
            return leaf

        handles = [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave,
                                                                                                  always_call=True),
                   self.model.get_input_embeddings().register_forward_hook(at_embedding),
                   self.model.get_output_embeddings().register_forward_hook(
                       functools.partial(_at_head, index, captured, self.transform))]
        rules = _rules(self.model, self.target.rules) if self.target.rules else contextlib.nullcontext()
        try:
            with frozen_parameters(self.model), layer_checkpointing(self.model, recompute), rules:
                yield
                for h in handles:
                    h.remove()
                handles = []
                if "logits" not in captured or "leaf" not in captured:
                    raise RuntimeError("a shared attribution forward ran no forward of the model")
                with torch.enable_grad(), self.clock():
                    self._backward(layout, index, weights, captured)
        finally:
            for h in handles:
                h.remove()

    def _backward(self, layout: ForwardLayout, index: torch.Tensor, w: torch.Tensor, captured: dict) -> None:
        """Read the probe from the kept logits, back-propagate the method's losses, store the projections."""
        t = self.target
        rows = layout.rows
        probe = read_probe(t.batch, layout, index, w, captured, self.shards)
        losses, weights = t.losses(probe, rows)
        losses = losses.reshape(rows.shape[0], t.columns)
        leaf, clean, lo = captured["leaf"], captured["clean"], captured["lo"]
        mine = (layout.flat >= lo) & (layout.flat < lo + clean.shape[0] * clean.shape[1])  # this shard's tokens
        at, row, col = layout.flat[mine] - lo, layout.row[mine], layout.col[mine]
        for c in range(t.columns):  # C backwards from one forward, never one per token
            losses[:, c].sum().backward(retain_graph=c + 1 < t.columns)
            flat = t.project(leaf.grad, clean).reshape(-1)
            self.projections[row, c, col] = flat[at].to(self.projections.device)
            leaf.grad = None
        self.weights[rows] = weights.to(self.weights.device)
        self.covered[rows] = True

    @property
    def seconds(self) -> float:
        """Seconds spent on the backwards of the forwards run inside :meth:`forward` so far (accelerator-synchronised
        at each backward's ends; the forwards themselves are not counted)."""
        return self.clock.seconds

    def result(self) -> torch.Tensor:
        """(B, L) float32 scores at reasoning positions of the rows attributed so far, 0 elsewhere (under Ulysses
        the same on every rank of the group: call it on all of them)."""
        projections = self.projections
        if self.shards is not None:  # each rank stored its own positions' projections
            projections = projections.clone()
            dist.all_reduce(projections, group=self.shards.group)
        scores = self.target.finish(projections, self.weights)
        keep = self.target.batch.reasoning_mask & self.covered[:, None]
        return torch.where(keep, scores, 0.0)


class SharedTeacher:
    """OAR-G's clean teacher probes read from the forwards run inside :meth:`forward` (docs/method.md §14): each
    row's probe is read from the LM head's output at its probe positions and kept in :attr:`table` for the method's
    noisy passes (``MethodInputs.teachers``). The forward itself is left as it is: no grad, no leaf, no backward.

    Args:
        model: the Hugging Face causal LM (or its FSDP wrapper) the caller runs.
        batch: the rows whose probes are read.
        shards: the Ulysses sequence-parallel group the forwards are sharded over, or None.
    """

    def __init__(self, model: torch.nn.Module, batch: AttributionBatch, shards: SequenceShards | None = None):
        self.model, self.batch = model, batch
        self.shards = shards if shards is not None and shards.size > 1 else None
        B = batch.input_ids.shape[0]
        self.table = DenseProbeTable(B)
        self.covered = torch.zeros(B, dtype=torch.bool, device=batch.input_ids.device)
        self.choices: list[tuple[int, float]] = []  # no backward here: the noisy passes choose their recompute
        self.clock = Stopwatch()  # the probe reads' seconds (the forwards are the caller's)
        self.transform = post_head_transform(model_config(model))  # the model's own soft-cap / scaling, or None

    @contextlib.contextmanager
    def forward(self, layout: ForwardLayout) -> Iterator[None]:
        """Run the model's forward(s) of ``layout``'s rows inside: their probes are read on the way out."""
        tokens = int(layout.flat.shape[0])
        index, weights = probe_index(layout, self.batch.probe.logit_weight)
        captured: dict[str, torch.Tensor] = {}

        def at_embedding(module, args, out):
            captured["lo"] = shard_start(self.shards, out, tokens)

        handles = [self.model.get_input_embeddings().register_forward_hook(at_embedding),
                   self.model.get_output_embeddings().register_forward_hook(
                       functools.partial(_at_head, index, captured, self.transform))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if "logits" not in captured:
            raise RuntimeError("a shared teacher forward ran no forward of the model")
        with torch.no_grad(), self.clock():
            probe = read_probe(self.batch, layout, index, weights, captured, self.shards)
            self.table.put(layout.rows.to(self.covered.device), probe)
            self.covered[layout.rows.to(self.covered.device)] = True

    @property
    def seconds(self) -> float:
        """Seconds spent reading the probes of the forwards run inside :meth:`forward` so far (accelerator-synchronised
        at each read's ends; the forwards themselves are not counted)."""
        return self.clock.seconds

    def teachers(self, rows: torch.Tensor | None = None) -> DenseProbeTable:
        """The table of every row's clean probe, or of ``rows`` (n,) long only, renumbered 0..n-1 in that order (a
        batch of those rows); under Ulysses the same on every rank of the group.

        Raises:
            RuntimeError: a row with reasoning tokens was not in any forward run inside :meth:`forward`.
        """
        device = self.covered.device
        picked = torch.arange(self.covered.shape[0], device=device) if rows is None else rows.to(device).long()
        missing = picked[self.batch.reasoning_mask.any(-1).to(device)[picked] & ~self.covered[picked]]
        if missing.numel():
            raise RuntimeError(f"oar: the old-log-prob pass held no forward of rows {missing.tolist()} whose clean "
                               "teacher OAR-G reads from it")
        if rows is None:
            return self.table
        table = DenseProbeTable(picked.shape[0])
        if self.table.logp is not None and picked.numel():
            table.put(torch.arange(picked.shape[0], device=device), self.table.get(picked))
        return table


def _at_head(index: torch.Tensor, captured: dict, transform: Transform | None, module, args, out) -> None:
    """Forward hook on the LM head: keep the probe positions' logits (n, K, V), read from the head's own output so
    that a sharding wrapper's backward hooks (FSDP regathering the head's weight) run as in any backward; the output
    is unchanged. ``transform``: what the model does to the head's output before returning it as logits (a soft-cap,
    a scale: :func:`~oar_verl.core.backends.families.post_head_transform`), applied to the kept positions, so that the
    probe reads the logits the caller and the method's own passes read. A shard reads its own positions (the others:
    index 0, ``captured["here"]`` False)."""
    flat = out.reshape(-1, out.shape[-1])
    lo = captured["lo"]
    here = (index >= lo) & (index < lo + flat.shape[0])
    captured["here"] = here
    kept = flat[torch.where(here, index - lo, 0)]
    captured["logits"] = kept if transform is None else transform(kept)


def read_probe(batch: AttributionBatch, layout: ForwardLayout, index: torch.Tensor, weights: torch.Tensor,
               captured: dict, shards: SequenceShards | None):
    """The :class:`~oar_verl.core.batch.probes.ProbeOutput` of the forward's n sequences from the kept logits
    (``index``, ``weights`` (n, K): :func:`probe_index`), the shards' partial sums summed over the group."""
    spec = batch.probe
    rows = layout.rows
    targets = spec.target_ids[rows[:, None], batch_columns(layout, index)]
    combine = None if shards is None else functools.partial(sum_over_group, group=shards.group)
    return probe_from_logits(captured["logits"], weights * captured["here"], targets, spec.joint[rows], combine)


def shard_start(shards: SequenceShards | None, embedded: torch.Tensor, tokens: int) -> int:
    """The first flat position of a forward of ``tokens`` that this rank's embedding output (b, s, H) holds: 0, or
    under Ulysses (``shards``) its shard's, rank × s of a (1, s) shard.

    verl (``FSDPEngineWithLMHead.prepare_model_inputs``) pads the packed row at its end, first to a multiple of
    ``pad_to_length_bucket`` when ``pad_to_length`` is set, then to a multiple of the group
    (``ulysses_pad_and_slice_inputs``), and gives rank r the r-th of ``size`` equal slices: every shard has the same
    s, ``s × size >= tokens``, and s may exceed ``tokens`` (a bucket longer than the micro-batch's real tokens); the
    positions past ``tokens`` are padding, which no probe or projection reads.

    Every rank of the run reaches this once per forward (verl runs as many micro-batches on every rank: a fixed
    micro-batch size over equal shards, or dynamic batch sizes with the count all-reduced over the data-parallel
    group), so the check's verdict is reduced over the default process group first: all ranks raise together.

    Raises:
        RuntimeError: on every rank, when any rank's embedding output is not one shard of a packed row that covers
            the forward's ``tokens``.
    """
    if shards is None:
        return 0
    n = embedded.shape[0] * embedded.shape[1]
    wrong = embedded.shape[0] != 1 or n * shards.size < tokens
    if any_over_ranks(wrong):
        where = (f"reached the embedding as {tuple(embedded.shape[:2])} on this rank, one of {shards.size}" if wrong
                 else "reached the embedding in another layout on another rank")
        raise RuntimeError(f"oar: a sequence-parallel forward of {tokens} packed tokens {where} (expected one shard "
                           "(1, s) of the packed row with s × the group's size >= its tokens)")
    return shards.rank * n


def batch_columns(layout: ForwardLayout, index: torch.Tensor) -> torch.Tensor:
    """(n, K) batch columns of the flat positions ``index`` (n, K) (a padding entry: its sequence's first token)."""
    col_of = torch.zeros(int(layout.flat.max()) + 1 if layout.flat.numel() else 1, dtype=torch.long,
                         device=layout.flat.device)
    col_of[layout.flat] = layout.col
    return col_of[index]


def _always(share: float, tokens: int) -> float:
    return share


def _rules(model: torch.nn.Module, attention_rule: str) -> contextlib.AbstractContextManager:
    from oar_verl.core.backends.rules import conservative_rules

    return conservative_rules(model, attention_rule)
