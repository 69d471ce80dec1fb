"""The attribution backend of a plain Hugging Face causal LM (or an FSDP-wrapped one): padded rows in column windows,
a key/value prefix cache for OAR-P's copies, a gradient method's hook at the input-embedding output.

A pass's rows are cut to the columns any of them uses (:func:`column_window`) and packed under the token budget as
rows × window (:mod:`oar_verl.core.backends.budget`), longest first; copies are packed in order. Full-vocabulary logits exist
only at the probe positions (``logits_to_keep``).

A backward pass (a gradient method's :class:`~oar_verl.core.backends.base.EmbeddingHook`): a forward hook on the input
embedding returns the clean output plus the method's noise on the reasoning tokens as a detached leaf, and every model
parameter is frozen for the pass, so no parameter gradient is created (no leak into the policy update, no optimizer or
FSDP reduce-scatter work) and the backward skips all weight-gradient matmuls. Under gradient checkpointing (the
actor's setting, and the default here) the pass keeps only each layer's input and recomputes one layer at a time in
the backward, like the training step; it still runs with eval numerics (:func:`layer_checkpointing`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from transformers.cache_utils import DynamicCache

from oar_verl.core.backends.base import DenseProbes, EmbeddingHook, OnProbe, Pass, frozen_parameters, reasoning_slots
from oar_verl.core.backends.budget import PassLimits, pack_copies, pack_rows
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.backends.prefix_cache import shared_prefix_cache
from oar_verl.core.batch.probes import logits_at, probe_from_logits, probe_keep_positions

logger = logging.getLogger("oar_verl")


def column_window(attention_mask: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) columns that hold a real token in any of ``rows``; padding-only columns are skipped."""
    used = attention_mask[rows].bool().any(0)
    if not bool(used.any()):
        return 0, attention_mask.shape[1]
    cols = used.nonzero().squeeze(1)
    return int(cols[0]), int(cols[-1]) + 1


class ModuleBackend(DenseProbes):
    """A Hugging Face causal LM, whole sequences per pass (:mod:`oar_verl.core.backends.base`).

    Args:
        model: the causal LM (or an FSDP wrapper), in eval mode; None for planning only.
        limits: the token budget of one pass (and optional caps and memory guard).
        prefix_cache: OAR-P copies reuse their row's clean key/value prefix (the model must support
            ``past_key_values``).
        checkpointing: checkpoint the decoder layers in backward passes; or (tokens of a pass) -> the share of them to
            checkpoint, chosen per pass (:func:`~oar_verl.core.backends.memory.recompute_policy`,
            ``algorithm.oar.recompute``).
        align: maps this rank's pass count to the count every data-parallel rank runs (default: its own).
    """

    shared_backwards = True  # the embedding leaf's graph is kept between a pass's backwards

    def __init__(self, model: torch.nn.Module | None, limits: PassLimits, *, prefix_cache: bool = True,
                 checkpointing: bool | Callable[[int], float] = True, align: Callable[[int], int] | None = None):
        self.model, self.limits = model, limits
        self.prefix_cache, self.checkpointing = prefix_cache, checkpointing
        self._align = align
        self._cache = None  # (row, key/value cache) of the last clean pass run with cache="keep"
        self.recomputed: list[float] = []  # per backward pass run: the share of layers it recomputed (logged)

    def plan(self, batch: AttributionBatch, rows: torch.Tensor, kind: str, ordered: bool = False
             ) -> list[torch.Tensor]:
        if ordered:  # copies, grouped by row: consecutive ones share a pass
            return [torch.arange(s, e, device=rows.device)
                    for s, e in pack_copies(rows, batch.attention_mask, self.limits, kind)]
        return pack_rows(batch.attention_mask[rows], self.limits, kind)

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe,
            hook: EmbeddingHook | None = None) -> list[torch.Tensor | None]:
        with (frozen_parameters(self.model) if hook else contextlib.nullcontext()):
            try:
                return [self._backward(batch, p, i, on_probe, hook) if hook else self._forward(batch, p, i, on_probe)
                        for i, p in enumerate(passes)]
            finally:
                self._cache = None

    def recomputes(self, tokens: int) -> float:
        """The share of the decoder layers a backward pass of ``tokens`` positions (rows × window) checkpoints."""
        choice = float(self.checkpointing(tokens) if callable(self.checkpointing) else self.checkpointing)
        self.recomputed.append(choice)
        return choice

    def embedding(self, token_id: int) -> torch.Tensor:
        return embedding_row(self.model, token_id)

    def mean_embedding(self) -> torch.Tensor:
        return embedding_mean(self.model)

    def _inputs(self, batch: AttributionBatch, p: Pass) -> tuple[int, int, dict, torch.Tensor | None]:
        """The pass's model inputs in its column window [lo, hi), and the (n, hi - lo) replaced positions (None: a
        clean pass)."""
        lo, hi = column_window(batch.attention_mask, p.rows)
        inputs = batch.model_inputs(p.rows, lo, hi)
        replaced = p.replaced()
        if replaced is not None:
            replaced = replaced[:, lo:hi]
            inputs["input_ids"] = p.replacement.input_ids(inputs["input_ids"], replaced, p.rows, lo)
        return lo, hi, inputs, replaced

    @torch.no_grad()
    def _forward(self, batch: AttributionBatch, p: Pass, i: int, on_probe: OnProbe) -> None:
        lo, hi, inputs, replaced = self._inputs(batch, p)
        spec = batch.probe.index(p.rows).columns(lo, hi)
        keep = probe_keep_positions(spec)
        if p.cache == "keep":
            # a cache of full layers (DynamicCache() without a config): the model's own would give sliding-window
            # layers (Gemma 2/3, Mistral) a window-long cache that cannot be cut back to a masked copy's prefix once a
            # row is longer than the window; the attention mask still applies the window
            out = self.model(**inputs, logits_to_keep=keep, use_cache=True, past_key_values=DynamicCache())
            self._cache = (int(p.rows[0]), out.past_key_values)
            logits = out.logits
        elif p.cache == "reuse":
            logits = self._suffix_logits(p, lo, inputs, replaced, keep)
        else:
            with embedding_replaced(self.model, p, replaced):
                logits = logits_at(self.model, keep, **inputs)
        on_probe(i, probe_from_logits(logits, spec.logit_weight[:, keep], spec.target_ids[:, keep], spec.joint))

    def _suffix_logits(self, p: Pass, lo: int, inputs: dict, replaced: torch.Tensor, keep: torch.Tensor
                       ) -> torch.Tensor:
        """Copies of the cached row recompute only the columns from their first masked one, on the clean prefix."""
        row, cache = self._cache or (None, None)
        if row != int(p.rows[0]):
            raise RuntimeError("a prefix-cache pass must follow its row's clean pass")
        t0 = int(p.first.min()) - lo
        if int(keep.min()) < t0:  # a probe position before the masked tokens: cannot come from the suffix
            raise ValueError("prefix_cache needs every probe position after the perturbed tokens")
        c = p.rows.shape[0]
        with embedding_replaced(self.model, p, replaced[:, t0:]):  # the suffix's own columns
            return self.model(input_ids=inputs["input_ids"][:, t0:], attention_mask=inputs["attention_mask"],
                              position_ids=inputs["position_ids"][:, t0:],
                              past_key_values=shared_prefix_cache(cache, t0, c), logits_to_keep=keep - t0,
                              use_cache=True).logits

    def _backward(self, batch: AttributionBatch, p: Pass, i: int, on_probe: OnProbe, hook: EmbeddingHook
                  ) -> torch.Tensor:
        """One backward pass: (n, [K,] L) float32 scores of the hook's projection in the rows' columns (0 outside
        the pass's column window)."""
        lo, hi, inputs, replaced = self._inputs(batch, p)
        if replaced is not None and p.replacement.embedding:
            raise NotImplementedError("a backward pass over copies whose embedding output is replaced")
        spec = batch.probe.index(p.rows).columns(lo, hi)
        mask = batch.reasoning_mask[p.rows, lo:hi]
        keep = probe_keep_positions(spec)

        def loss() -> torch.Tensor:
            logits = logits_at(self.model, keep, **inputs)
            return on_probe(i, probe_from_logits(logits, spec.logit_weight[:, keep], spec.target_ids[:, keep],
                                                 spec.joint))

        noise = None if hook.noise is None else lambda clean: hook.noise(i, *reasoning_slots(mask), clean)
        with layer_checkpointing(self.model, self.recomputes(p.rows.shape[0] * (hi - lo))):
            scores = embedding_scores(self.model, mask, noise, loss, hook)
        out = scores.new_zeros(*scores.shape[:-1], batch.input_ids.shape[1])
        out[..., lo:hi] = scores
        return out


@contextlib.contextmanager
def whole_table(model: torch.nn.Module, emb: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The whole (V, H) table of ``model``'s input embedding ``emb`` for the duration: an FSDP2-sharded table (a
    DTensor) gathered; under FSDP1 the parameters of the unit that holds it gathered (outside a forward its weight is a
    view of freed storage); a DeepSpeed ZeRO-3 partitioned parameter (an empty local tensor outside its module's
    forward) gathered; else the weight itself. Gathering is a collective: every data-parallel rank calls it, as every
    rank runs the attribution. V × H transiently (FSDP1: the holding unit's parameters), once per batch, before any
    pass."""
    weight = emb.weight
    unit = _fsdp1_unit(model, emb)
    if unit is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            yield emb.weight
    elif hasattr(weight, "full_tensor"):
        yield weight.full_tensor()
    elif hasattr(weight, "ds_id"):  # ZeRO-3: gathered on entry, partitioned again on exit
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield weight.data
    else:
        yield weight


def _fsdp1_unit(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module | None:
    """The innermost FSDP1 unit of ``model`` that holds ``module``'s parameters, or None (no FSDP1)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed
        return None
    unit = None
    for m in model.modules():  # pre-order: a unit nested inside another comes after it
        if isinstance(m, FullyShardedDataParallel) and any(x is module for x in m.module.modules()):
            unit = m
    return unit


def embedding_row(model: torch.nn.Module, token_id: int) -> torch.Tensor:
    """(H,) the input embedding of ``token_id`` as the model's embedding module outputs it (with a scaled embedding's
    ``embed_scale``); a sharded table is gathered for the call (:func:`whole_table`)."""
    emb = model.get_input_embeddings()
    with torch.no_grad(), whole_table(model, emb) as table:
        row = table[token_id].detach().clone()
    return row * getattr(emb, "embed_scale", 1.0)


def embedding_mean(model: torch.nn.Module) -> torch.Tensor:
    """(H,) the mean of the input-embedding table's rows as the embedding module outputs them (with a scaled
    embedding's ``embed_scale``), accumulated in float32 at least; a sharded table is gathered (:func:`whole_table`)."""
    emb = model.get_input_embeddings()
    with torch.no_grad(), whole_table(model, emb) as table:
        mean = table.to(torch.promote_types(table.dtype, torch.float32)).mean(0)
        dtype = table.dtype
    return (mean * getattr(emb, "embed_scale", 1.0)).to(dtype)


@contextlib.contextmanager
def embedding_replaced(model: torch.nn.Module, p: Pass, replaced: torch.Tensor | None) -> Iterator[None]:
    """For the duration, the input embedding's output (n, s, H) has the ``replaced`` (n, s) positions set to the pass's
    replacement vector (an embedding operator's copies); nothing otherwise."""
    if replaced is None or not p.replacement.embedding:
        yield
        return
    handle = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: p.replacement.at_embedding(out, replaced))
    try:
        yield
    finally:
        handle.remove()


def embedding_scores(model: torch.nn.Module, mask: torch.Tensor,
                     noise: Callable[[torch.Tensor], torch.Tensor] | None, loss: Callable[[], torch.Tensor],
                     hook: EmbeddingHook) -> torch.Tensor:
    """(b, s) float32 (or (b, K, s) with ``hook.outputs`` = K > 1) ``hook.project`` scores of a forward whose
    input-embedding output (b, s, H) gets ``noise(clean)`` (m, H) added at the m positions of ``mask`` (b, s) bool
    (``clean`` (m, H): their clean outputs, row-major like :func:`~oar_verl.core.backends.base.reasoning_slots`), whose
    per-row loss ``loss()`` (b,) or (b, K) is back-propagated once per column (rows are independent in a forward, so
    each gets its own gradient; the K backwards share the forward). The embedding output is returned as a detached
    leaf, the only tensor that requires grad; plain backwards work with every checkpointing mode."""
    captured: dict[str, torch.Tensor] = {}

    def at_embedding(module, args, out):
        clean = out.detach()
        leaf = clean.clone()
        if noise is not None:
            leaf[mask] += noise(clean[mask]).to(clean.dtype)
        leaf.requires_grad_(True)
        captured["clean"], captured["leaf"] = clean, leaf
        return leaf

    handle = model.get_input_embeddings().register_forward_hook(at_embedding)
    grads = []
    try:
        with torch.enable_grad():
            losses = loss().reshape(-1, hook.outputs)  # (rows, K): a packed sequence holds several rows
            for k in range(hook.outputs):  # K backwards from one forward, never one per token
                losses[:, k].sum().backward(retain_graph=k + 1 < hook.outputs)
                grads.append(captured["leaf"].grad)
                captured["leaf"].grad = None
    finally:
        handle.remove()
    scores = [hook.project(g, captured["clean"]) for g in grads]
    return scores[0] if hook.outputs == 1 else torch.stack(scores, 1)


@contextlib.contextmanager
def layer_checkpointing(model: torch.nn.Module, enabled: bool | float) -> Iterator[None]:
    """Gradient checkpointing of the decoder layers for the duration, with eval numerics: of every layer (True), of
    none (False), or of the first ``round(share × layers)`` for a share in [0, 1] (the others keep their activations
    for the backward: recompute only where memory needs it, :func:`~oar_verl.core.backends.memory.recompute_policy`).

    Hugging Face decoder layers (``GradientCheckpointingLayer``) checkpoint when their ``gradient_checkpointing`` and
    ``training`` flags are both set; dropout reads the flags of their submodules. So the checkpointed layers' own
    ``training`` flags are raised (and checkpointing switched on where the model did not enable it), the others'
    lowered, nothing else, and all is restored after. Models without such layers run unchanged (logged once).
    """
    share = float(enabled)
    if share == 0.0:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        _warn_once("oar: the model has no Hugging Face checkpointing layers; OAR-G runs without gradient checkpointing")
    n = round(share * len(layers))
    saved = [(m, m.training, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    try:
        for m in layers[:n]:
            if not m.gradient_checkpointing:
                m.gradient_checkpointing = True
                m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                   use_reentrant=False)
            m.training = True  # this module only: its submodules (dropout) stay in eval
        for m in layers[n:]:
            m.training = False  # kept: its activations are saved for the backward
        yield
    finally:
        for m, training, checkpointing, func in saved:
            m.training, m.gradient_checkpointing = training, checkpointing
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
