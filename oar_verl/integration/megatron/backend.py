"""The attribution backend of verl's Megatron engine (:mod:`oar_verl.core.engine`): every method of the core -- OAR-P
under every perturbation policy, OAR-G with K noise draws -- runs through it unchanged.

* **Layout**: each row's real tokens from position 0 (:class:`.engine.EngineRows`); a pass is one engine
  micro-batch. Passes are planned as rows (or copies, as long as their rows) per micro-batch under the token budget,
  rows × the longest sequence of any rank (the engine pads a micro-batch to its longest row).
* **Run**: all passes of a ``run`` go through ONE engine call (megatron-core pipelines the micro-batches), each padded
  to the same row count with copies of its first row whose results are dropped; the micro-batch size is all-reduced,
  so every data-parallel rank issues the same call with the same number of micro-batches. Forward-only passes call
  ``infer_batch``; OAR-G's student passes call ``forward_backward_batch`` with frozen parameters, no gradient
  finalisation and the engine's full recomputation (:func:`.engine.no_param_grads`, :func:`.engine.full_recompute`).
* **Probe**: the engine's logits processor on the last stage reads the vocab-parallel probe (never gathered,
  :mod:`.vocab_parallel`) and hands it to the method, whose per-row loss becomes the engine's loss.
* **Noise and gradient**: a forward hook on the first stage's embedding (output ``[s, b, h]``, ``[s/tp, b, h]`` under
  sequence parallelism) adds the core's seeded noise and returns a detached leaf; a tensor hook turns ∂J/∂e into
  |⟨∂J/∂e_t, e_t⟩|. Sequence-parallel chunks are gathered over the tensor-parallel group; the scores then go from the
  first to every pipeline stage with one broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from oar_verl.core.budget import PassLimits
from oar_verl.core.engine import OnProbe, Pass
from oar_verl.core.gradient import embedding_projection, mask_noise
from oar_verl.core.layout import AttributionBatch
from oar_verl.integration.collectives import max_over_ranks
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
        mask_token_id: OAR-P's replacement token.

    Raises:
        MegatronLayoutError: a layout OAR does not support (context parallelism, virtual pipeline, fused kernels,
            multi-token prediction, per-token-loss regime).
    """

    prefix_cache = False  # the engine has no key/value cache path: OAR-P runs the batched copies, same numbers

    def __init__(self, engine, limits: PassLimits, *, mask_token_id: int | None = None):
        check_megatron_layout(engine)
        self.engine, self.limits, self.mask_token_id = engine, limits, mask_token_id
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

    def run(self, batch: AttributionBatch, passes: Sequence[Pass], on_probe: OnProbe, noise_std: float = 0.0,
            project: str = "input") -> list[torch.Tensor | None]:
        rows = self.rows(batch)
        mbs = max_over_ranks(max((p.rows.shape[0] for p in passes), default=0))
        if not passes or mbs == 0:
            return [None] * len(passes)
        noisy = passes[0].seeds is not None
        if any((p.seeds is not None) != noisy for p in passes):
            raise ValueError("one Megatron engine call runs either forward-only or noisy passes, not both")
        # slot k·mbs + j is row j of pass k; short passes are topped up with their first row, unmasked (dropped)
        src, ids = [], []
        for p in passes:  # per pass (and per row of it), never per token
            replaced = p.replaced()
            for j, b in enumerate(p.rows.tolist() + [int(p.rows[0])] * (mbs - p.rows.shape[0])):
                s0, n = rows.start[b], rows.n[b]
                tokens = rows.ids[b]
                if replaced is not None and j < p.rows.shape[0]:
                    tokens = tokens.masked_fill(replaced[j, s0:s0 + n].cpu(), int(self.mask_token_id))
                src.append(b)
                ids.append(tokens)
        src_t = torch.tensor(src, dtype=torch.long)

        def on_micro_batch(slots: torch.Tensor, probe: VPProbe, joint: torch.Tensor) -> torch.Tensor | None:
            k = int(slots[0]) // mbs
            n = passes[k].rows.shape[0]
            loss = on_probe(k, probe.head(n))
            return None if loss is None else torch.cat([loss, loss.new_zeros(mbs - n)])  # dropped rows add nothing

        hook = ProbeHook(self.engine, rows, lambda slots: src_t[slots], on_micro_batch, need_loss=noisy)
        td = engine_batch(ids, list(range(len(ids))), mbs, self.engine.engine_config.use_fused_kernels)
        if not noisy:
            run_engine(self.engine, td, hook, forward_only=True)
            return [None] * len(passes)
        return self._student_call(batch, passes, rows, ids, mbs, noise_std, project, td, hook)

    def _student_call(self, batch: AttributionBatch, passes: Sequence[Pass], rows: EngineRows,
                      ids: list[torch.Tensor], mbs: int, noise_std: float, project: str, td,
                      hook: ProbeHook) -> list[torch.Tensor]:
        """Backward passes in one forward-backward: the (n, L) signed projection of every pass, on every stage."""
        from megatron.core import parallel_state as mpu

        emb = embedding_module(self.engine)
        base = _mask_embedding(emb, int(self.mask_token_id)) if emb is not None and project == "mask" else None
        sp = bool(getattr(self.engine.tf_config, "sequence_parallel", False))
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        scores: dict[int, tuple[torch.Tensor, bool]] = {}
        state = {"mb": 0}

        def add_noise(module, args, kwargs, out):
            k = state["mb"]
            state["mb"] += 1
            p = passes[k]
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            s_full = input_ids.shape[1]
            chunked = out.shape[0] != s_full  # sequence-parallel scatter inside the embedding: [s/tp, b, h]
            if chunked and not (sp and out.shape[0] * tp == s_full):
                raise RuntimeError(f"OAR-G: embedding output {tuple(out.shape)} for input {tuple(input_ids.shape)}")
            for i, x in enumerate(ids[k * mbs:(k + 1) * mbs]):  # the schedule must hand us micro-batch k
                if not torch.equal(input_ids[i, :len(x)].cpu(), x):
                    raise RuntimeError("OAR-G: embedding forward does not match the expected micro-batch order")
            mask = torch.zeros(mbs, s_full, dtype=torch.bool)
            for i, b in enumerate(p.rows.tolist()):  # real rows only: the top-up rows get no noise
                mask[i, :rows.n[b]] = rows.reasoning[b]
            mask = mask.to(out.device)
            noise = torch.zeros(mbs, s_full, out.shape[-1], dtype=out.dtype, device=out.device)
            seeds = torch.cat([p.seeds.cpu(), p.seeds.new_zeros(mbs - p.rows.shape[0]).cpu()])
            noise[mask] = mask_noise(mask, out.shape[-1], noise_std, seeds).to(out.dtype)
            noise = noise.transpose(0, 1)  # [s, b, h] like the embedding output
            if chunked:
                s_loc = out.shape[0]
                noise = noise[tp_rank * s_loc:(tp_rank + 1) * s_loc]
            clean = out.detach()
            leaf = (clean + noise).requires_grad_(True)

            def grad_x_input(grad, clean=clean, k=k):
                scores[k] = (embedding_projection(grad.transpose(0, 1), clean.transpose(0, 1), base),
                             chunked)  # (b, s_local)

            leaf.register_hook(grad_x_input)
            return leaf

        handle = emb.register_forward_hook(add_noise, with_kwargs=True) if emb is not None else None
        try:
            with no_param_grads(self.engine), full_recompute(self.engine):
                run_engine(self.engine, td, hook, forward_only=False)
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
                    sal[at + i, s0:s0 + n] = torch.where(rows.reasoning[b], sc[i, :n], 0.0)
                at += p.rows.shape[0]
        if mpu.get_pipeline_model_parallel_world_size() > 1:  # first stage -> every stage of this pipeline
            buf = sal.to(get_device_id())
            dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_first_rank(),
                           group=mpu.get_pipeline_model_parallel_group())
            sal = buf.cpu()
        return list(sal.split([p.rows.shape[0] for p in passes]))


def _mask_embedding(emb, mask_token_id: int) -> torch.Tensor:
    """(H,) the mask token's word embedding, read from the vocab-parallel table (its row lives on one tensor-parallel
    rank; a sum over the group brings it to all). The attributed models add no absolute position embedding."""
    from megatron.core import parallel_state as mpu

    words = emb.word_embeddings
    lo, hi = words.vocab_start_index, words.vocab_end_index
    row = words.weight[mask_token_id - lo].detach().clone() if lo <= mask_token_id < hi else \
        torch.zeros(words.weight.shape[-1], dtype=words.weight.dtype, device=words.weight.device)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(row, group=mpu.get_tensor_model_parallel_group())
    return row
