"""The attribution backend of verl's Megatron engine (:mod:`oar_verl.core.backends.base`): every method of the core
-- OAR-P under every perturbation policy, OAR-G with K noise draws, fisher, conservative (its rules: :mod:`.rules`) --
runs through it unchanged.

A pass is one engine micro-batch (rows of :class:`.engine.EngineRows`, planned under the token budget as rows × the
longest sequence of any rank); all passes of a ``run`` go through ONE engine call with an all-reduced micro-batch size,
so every data-parallel rank issues the same call. The last stage's logits processor reads the vocab-parallel probe
(:mod:`.vocab_parallel`); a hook on the first stage's embedding adds the method's noise and turns ∂J/∂e into its
projection, and the scores go to every pipeline stage. One backward per micro-batch: a hook with K > 1 outputs is
refused. Details: docs/verl.md, "How the Megatron backend runs passes" (in "Ulysses, Megatron, and what is refused").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from oar_verl.core.backends.base import EmbeddingHook, OnProbe, Pass, reasoning_slots
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.backends.collectives import max_over_ranks
from oar_verl.integration.megatron.engine import (CleanTable, EngineRows, ProbeHook, engine_batch, engine_rows,
                                                  full_recompute, micro_batch_rows, no_param_grads, run_engine)
from oar_verl.integration.megatron.layout_checks import check_megatron_layout
from oar_verl.integration.megatron.vocab_parallel import VPProbe, vp_outcome_shift


def embedding_module(engine):
    """The first pipeline stage's embedding (``GPTModel.embedding``), None on other stages."""
    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(engine.module[0])
    return getattr(gpt, "embedding", None) if getattr(gpt, "pre_process", False) else None


class MegatronBackend:
    """verl's ``MegatronEngineWithLMHead`` as an attribution backend (see the module docstring).

    Use under ``engine.eval_mode()`` on every rank of the actor mesh (all tensor/pipeline ranks of a data-parallel
    group hold the same batch, as verl dispatches ``compute_log_prob``). Importance is complete on the engine's
    collecting rank (``engine.is_mp_src_rank_with_outputs()``: tp0, last pipeline stage), like ``compute_log_prob``'s
    outputs.

    Args:
        engine: the initialised engine.
        limits: the token budget of one micro-batch (rows × the longest sequence); caps apply.

    Raises:
        MegatronLayoutError: a layout OAR does not support (context parallelism, virtual pipeline, fused kernels,
            multi-token prediction, per-token-loss regime).
    """

    prefix_cache = False  # the engine has no key/value cache path: OAR-P runs the batched copies, same numbers
    shared_backwards = False  # the engine's schedule runs one backward per micro-batch

    def __init__(self, engine, limits: PassLimits):
        check_megatron_layout(engine)
        self.engine, self.limits = engine, limits
        self._rows: tuple[AttributionBatch, EngineRows] | None = None

    def rows(self, batch: AttributionBatch) -> EngineRows:
        if self._rows is None or self._rows[0] is not batch:
            self._rows = (batch, engine_rows(batch))
        return self._rows[1]

    def plan(self, batch: AttributionBatch, rows: torch.Tensor, kind: str, ordered: bool = False
             ) -> list[torch.Tensor]:
        mbs = micro_batch_rows(self.rows(batch), self.limits, self.limits.copies if ordered else self.limits.rows)
        n = rows.shape[0]
        return [torch.arange(s, min(s + mbs, n), device=rows.device) for s in range(0, n, mbs)]

    def align(self, n: int) -> int:
        return max_over_ranks(n)

    def table(self, size: int) -> CleanTable:
        return CleanTable()

    def shift(self, clean, probe: VPProbe, joint: torch.Tensor) -> torch.Tensor:
        return vp_outcome_shift(clean, probe, joint.to(probe.zbar.device))

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's result on every stage (tensor-parallel ranks of a stage agree already)."""
        from megatron.core import parallel_state as mpu
        from verl.utils.device import get_device_id

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return x
        buf = x.to(get_device_id())
        dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        return buf.to(x.device)

    def propagation_rules(self, attention_rule: str):
        """The conservative propagation rules as hooks on the engine's layers (:mod:`.rules`; local and
        TransformerEngine specs)."""
        from oar_verl.integration.megatron.rules import megatron_rules

        return megatron_rules(self.engine.module, attention_rule)

    def embedding(self, token_id: int) -> torch.Tensor | None:
        """(H,) the token's word embedding on the first pipeline stage (None on the others, which never project)."""
        emb = embedding_module(self.engine)
        return None if emb is None else _token_embedding(emb, int(token_id))

    def mean_embedding(self) -> torch.Tensor | None:
        """(H,) the mean of the word-embedding table's rows (the model's vocabulary, not Megatron's padding rows) on the
        first pipeline stage (None on the others)."""
        emb = embedding_module(self.engine)
        hf = getattr(self.engine.model_config, "hf_config", None)
        return None if emb is None else _mean_embedding(emb, getattr(hf, "vocab_size", None))

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe,
            hook: EmbeddingHook | None = None) -> list[torch.Tensor | None]:
        if hook is not None and hook.outputs != 1:
            raise ValueError(f"the Megatron backend runs one backward per micro-batch; a hook with {hook.outputs} "
                             "outputs per row needs that many passes")
        rows = self.rows(batch)
        mbs = max_over_ranks(max((p.rows.shape[0] for p in passes), default=0))
        if not passes or mbs == 0:
            return [None] * len(passes)
        # slot k·mbs + j is row j of pass k; short passes are topped up with their first row, unmasked (dropped)
        src, ids = [], []
        for p in passes:  # per pass (and per row of it), never per token
            replaced = p.replaced()
            for j, b in enumerate(p.rows.tolist() + [int(p.rows[0])] * (mbs - p.rows.shape[0])):
                s0, n = rows.start[b], rows.n[b]
                tokens = rows.ids[b]
                if replaced is not None and j < p.rows.shape[0]:
                    tokens = p.replacement.input_ids(tokens[None], replaced[j:j + 1, s0:s0 + n].cpu(),
                                                     p.rows[j:j + 1], s0)[0]
                src.append(b)
                ids.append(tokens)
        src_t = torch.tensor(src, dtype=torch.long)

        def on_micro_batch(slots: torch.Tensor, probe: VPProbe, joint: torch.Tensor) -> torch.Tensor | None:
            k = int(slots[0]) // mbs
            n = passes[k].rows.shape[0]
            loss = on_probe(k, probe.head(n))
            return None if loss is None else torch.cat([loss, loss.new_zeros(mbs - n)])  # dropped rows add nothing

        probe_hook = ProbeHook(self.engine, rows, lambda slots: src_t[slots], on_micro_batch,
                               need_loss=hook is not None)
        td = engine_batch(ids, list(range(len(ids))), mbs, self.engine.engine_config.use_fused_kernels)
        replaces = any(p.first is not None and p.replacement.embedding for p in passes)
        if hook is None:
            emb = embedding_module(self.engine) if replaces else None
            handle = None if emb is None else emb.register_forward_hook(
                self._replacing_hook(passes, rows, ids, mbs), with_kwargs=True)
            try:
                run_engine(self.engine, td, probe_hook, forward_only=True)
            finally:
                if handle is not None:
                    handle.remove()
            return [None] * len(passes)
        if replaces:
            raise NotImplementedError("a backward pass over copies whose embedding output is replaced")
        return self._backward_call(batch, passes, rows, ids, mbs, hook, td, probe_hook)

    def _replacing_hook(self, passes: Sequence[Pass], rows: EngineRows, ids: list[torch.Tensor], mbs: int):
        """A forward hook on the first stage's embedding that sets the embedding output ``[s, b, h]`` (``[s/tp, b, h]``
        under sequence parallelism) of micro-batch k's replaced positions to pass k's replacement vector."""
        from megatron.core import parallel_state as mpu

        tp_rank = mpu.get_tensor_model_parallel_rank()
        next_micro_batch = _MicroBatches(passes, ids, mbs, "OAR-P")

        def at_embedding(module, args, kwargs, out):
            _, p, input_ids = next_micro_batch(args, kwargs)
            replaced = p.replaced()
            if replaced is None or not p.replacement.embedding:
                return out
            replaced = replaced.cpu()
            mask = torch.zeros(mbs, input_ids.shape[1], dtype=torch.bool)
            for i, b in enumerate(p.rows.tolist()):  # real rows only: the top-up rows stay clean
                s0, n = rows.start[b], rows.n[b]
                mask[i, :n] = replaced[i, s0:s0 + n]
            mask = mask.t()  # [s, b] like the embedding output
            s_loc = out.shape[0]
            if s_loc != mask.shape[0]:  # sequence-parallel chunk of this tensor-parallel rank
                mask = mask[tp_rank * s_loc:(tp_rank + 1) * s_loc]
            return p.replacement.at_embedding(out, mask)

        return at_embedding

    def _backward_call(self, batch: AttributionBatch, passes: Sequence[Pass], rows: EngineRows,
                       ids: list[torch.Tensor], mbs: int, hook: EmbeddingHook, td, probe_hook: ProbeHook
                       ) -> list[torch.Tensor]:
        """Backward passes in one forward-backward: the (n, L) projection of every pass, on every stage."""
        from megatron.core import parallel_state as mpu

        emb = embedding_module(self.engine)
        sp = bool(getattr(self.engine.tf_config, "sequence_parallel", False))
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        scores: dict[int, tuple[torch.Tensor, bool]] = {}
        next_micro_batch = _MicroBatches(passes, ids, mbs, "OAR-G")

        def at_embedding(module, args, kwargs, out):
            k, p, input_ids = next_micro_batch(args, kwargs)
            s_full = input_ids.shape[1]
            chunked = out.shape[0] != s_full  # sequence-parallel scatter inside the embedding: [s/tp, b, h]
            if chunked and not (sp and out.shape[0] * tp == s_full):
                raise RuntimeError(f"OAR-G: embedding output {tuple(out.shape)} for input {tuple(input_ids.shape)}")
            mask = torch.zeros(mbs, s_full, dtype=torch.bool)
            for i, b in enumerate(p.rows.tolist()):  # real rows only: the top-up rows get no noise
                mask[i, :rows.n[b]] = rows.reasoning[b]
            clean = out.detach()
            if hook.noise is None:
                leaf = clean.clone()
            else:
                # this rank's positions (its sequence-parallel chunk), each with its row and reasoning rank in the
                # whole row, and its clean embedding output
                slot, rank = reasoning_slots(mask)
                col = mask.nonzero()[:, 1]
                s_loc, lo = out.shape[0], (tp_rank * out.shape[0] if chunked else 0)
                here = (col >= lo) & (col < lo + s_loc)
                slot, rank, col = slot[here], rank[here], col[here] - lo
                at = (col.to(out.device), slot.to(out.device))  # [s, b] indices of the embedding output
                noise = torch.zeros_like(clean)
                noise[at] = hook.noise(k, slot, rank, clean[at]).to(out.device, out.dtype)
                leaf = clean + noise  # a new tensor already: no clone of the clean output first
            leaf.requires_grad_(True)

            def project(grad, clean=clean, k=k):
                scores[k] = (hook.project(grad.transpose(0, 1), clean.transpose(0, 1)), chunked)  # (b, s_local)

            leaf.register_hook(project)
            return leaf

        handle = emb.register_forward_hook(at_embedding, with_kwargs=True) if emb is not None else None
        try:
            with no_param_grads(self.engine), full_recompute(self.engine):
                run_engine(self.engine, td, probe_hook, forward_only=False)
        finally:
            if handle is not None:
                handle.remove()
        return self._spread(batch, passes, rows, scores, emb is not None, tp)

    def _spread(self, batch: AttributionBatch, passes: Sequence[Pass], rows: EngineRows,
                scores: dict[int, tuple[torch.Tensor, bool]], first_stage: bool, tp: int) -> list[torch.Tensor]:
        """Per pass (n, L) saliency in batch columns from the first stage's per-micro-batch scores, on every stage."""
        from megatron.core import parallel_state as mpu
        from verl.utils.device import get_device_id

        L = batch.input_ids.shape[1]
        sal = torch.zeros(sum(p.rows.shape[0] for p in passes), L, dtype=torch.float32)
        if first_stage:
            if len(scores) != len(passes):
                raise RuntimeError(f"OAR-G: {len(scores)} embedding gradients for {len(passes)} micro-batches")
            at = 0
            for k, p in enumerate(passes):  # per pass, then per row
                sc, chunked = scores[k]
                if chunked:  # sequence-parallel chunks -> the full sequence on every tensor-parallel rank
                    local = sc.t().contiguous()  # [s/tp, b]
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local, group=mpu.get_tensor_model_parallel_group())
                    sc = torch.cat(parts, 0).t()
                sc = sc.cpu()
                for i, b in enumerate(p.rows.tolist()):
                    s0, n = rows.start[b], rows.n[b]
                    sal[at + i, s0:s0 + n] = sc[i, :n]
                at += p.rows.shape[0]
        if mpu.get_pipeline_model_parallel_world_size() > 1:  # first stage -> every stage of this pipeline
            buf = sal.to(get_device_id())
            dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_first_rank(),
                           group=mpu.get_pipeline_model_parallel_group())
            sal = buf.cpu()
        return list(sal.split([p.rows.shape[0] for p in passes]))


class _MicroBatches:
    """The embedding forward hooks' view of the schedule: each call is the next micro-batch k, returned as (k, pass k,
    its (b, s) input ids), checked against the rows pass k must hold (the hooks count micro-batches: a schedule that
    reordered them would attribute the wrong rows)."""

    def __init__(self, passes: Sequence[Pass], ids: list[torch.Tensor], mbs: int, who: str):
        self.passes, self.ids, self.mbs, self.who, self.k = passes, ids, mbs, who, 0

    def __call__(self, args, kwargs) -> tuple[int, Pass, torch.Tensor]:
        k, self.k = self.k, self.k + 1
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        for i, x in enumerate(self.ids[k * self.mbs:(k + 1) * self.mbs]):
            if not torch.equal(input_ids[i, :len(x)].cpu(), x):
                raise RuntimeError(f"{self.who}: embedding forward does not match the expected micro-batch order")
        return k, self.passes[k], input_ids


def _token_embedding(emb, token_id: int) -> torch.Tensor:
    """(H,) a token's word embedding, read from the vocab-parallel table (its row lives on one tensor-parallel rank; a
    sum over the group brings it to all). The attributed models add no absolute position embedding."""
    from megatron.core import parallel_state as mpu

    words = emb.word_embeddings
    lo, hi = words.vocab_start_index, words.vocab_end_index
    row = words.weight[token_id - lo].detach().clone() if lo <= token_id < hi else \
        torch.zeros(words.weight.shape[-1], dtype=words.weight.dtype, device=words.weight.device)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(row, group=mpu.get_tensor_model_parallel_group())
    return row


def _mean_embedding(emb, vocab: int | None) -> torch.Tensor:
    """(H,) the mean of the first ``vocab`` rows of the vocab-parallel word-embedding table (each tensor-parallel rank
    sums its own rows, a sum over the group brings the total to all), in the table's dtype."""
    from megatron.core import parallel_state as mpu

    words = emb.word_embeddings
    lo, hi = words.vocab_start_index, words.vocab_end_index
    weight = words.weight.detach()
    total = vocab if vocab is not None else getattr(words, "num_embeddings", hi - lo)
    acc = torch.promote_types(weight.dtype, torch.float32)
    keep = torch.arange(lo, hi, device=weight.device) < total  # Megatron pads the vocabulary: its rows are not words
    s = weight[keep].to(acc).sum(0)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(s, group=mpu.get_tensor_model_parallel_group())
    return (s / total).to(weight.dtype)
