"""OAR-P and OAR-G through verl's Megatron engine, as engine calls (see :mod:`.engine` for the plumbing).

* **OAR-P**: one forward-only pass over the clean rows (probe distributions kept on the last stage), then one pass over
  all masked copies -- built by the core's :func:`~oar_verl.core.perturbation.masked_copies` -- in micro-batches sized
  by the token budget (megatron-core pipelines them); each copy's KL against its clean row is computed in the logits
  processor.
* **OAR-G**: a forward-only teacher pass, then one ``forward_backward_batch`` whose loss is J = KL(p0 ‖ p_noisy) (or
  φ0 − φ_noisy). A forward hook on the first stage's embedding (output ``[s, b, h]``) adds the seeded noise of
  :func:`oar_verl.core.gradient.reasoning_noise` on the reasoning positions and returns a detached leaf; a tensor hook
  on that leaf turns ∂J/∂e into |⟨∂J/∂e_t, e_t⟩| per token during the backward. Parameters are frozen and gradient
  finalisation is off for the call (:func:`.engine.no_param_grads`); with the engine's full activation recomputation
  the pass recomputes like the training step does (:func:`.engine.full_recompute`). Sequence-parallel embedding
  chunks are gathered over the tensor-parallel group; the scores then go from the first to every pipeline stage with
  one broadcast.

Data-parallel ranks issue equal collective counts: each method makes exactly two engine calls, and before each the
micro-batch count is all-reduced (max) and short ranks top up with filler rows whose results are dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oar_verl.core.budget import PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.gradient import reasoning_noise
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.perturbation import copy_masks, masked_copies
from oar_verl.integration.megatron.engine import (CleanTable, EngineRows, ProbeHook, engine_batch, fill_to_ranks,
                                                  full_recompute, micro_batch_rows, no_param_grads, run_engine)
from oar_verl.integration.megatron.vocab_parallel import vp_outcome_shift


def clean_pass(engine, rows: EngineRows, mbs: int) -> CleanTable:
    """Forward-only pass over the clean rows; their probes stay on the last stage."""
    B = len(rows.n)
    total = fill_to_ranks(B, mbs)
    order = list(range(B)) + [0] * (total - B)
    ids = [-1 if k >= B else b for k, b in enumerate(order)]
    table = CleanTable()

    def on_probe(row_t, probe, joint):
        table.put(row_t.tolist(), probe)
        return None

    hook = ProbeHook(engine, rows, lambda r: r.clamp(min=0), on_probe, need_loss=False)  # fillers: row 0
    if total:
        td = engine_batch([rows.ids[b] for b in order], ids, mbs, engine.engine_config.use_fused_kernels)
        run_engine(engine, td, hook, forward_only=True)
    return table


def oar_p(engine, batch: AttributionBatch, rows: EngineRows, cfg: OARConfig, limits: PassLimits,
          mask_token_id: int) -> torch.Tensor | None:
    """(B, L) OAR-P scores on the last pipeline stage (None elsewhere): a clean pass, then all masked copies."""
    from megatron.core import parallel_state as mpu

    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    clean = clean_pass(engine, rows, micro_batch_rows(rows, limits, limits.rows))
    # the masked copies, exactly as the core's OAR-P builds them; the engine needs one token row per copy
    src, first, blocks = masked_copies(batch.reasoning_mask.bool().cpu(), cfg.mask_span)
    N = int(src.shape[0])
    per_pass = micro_batch_rows(rows, limits, limits.copies)  # a copy is as long as its row
    total = fill_to_ranks(N, per_pass)
    src_l = src.tolist()
    ids, masks = [], []
    for b in src.unique().tolist():  # per source row: all its copies at once
        sel = src == b
        s, n = rows.start[b], rows.n[b]
        m = copy_masks(blocks[b, s:s + n].expand(int(sel.sum()), -1), first[sel] - s)  # (copies, n)
        masks.append(m)
        ids.extend(rows.ids[b].expand(m.shape[0], -1).masked_fill(m, mask_token_id).unbind())
    ids.extend([rows.ids[0]] * (total - N))  # fillers: row 0 unmasked, results dropped
    copy_src = torch.tensor(src_l + [-1] * (total - N), dtype=torch.long)
    shifts = torch.zeros(N, dtype=torch.float32)

    def on_probe(row_t, probe, joint):
        r = row_t.cpu()
        base = clean.get(copy_src[r.clamp(min=0)].masked_fill(r < 0, -1).tolist(), probe)
        s = vp_outcome_shift(base, probe, joint).float().cpu()
        keep = r >= 0
        shifts[r[keep]] = s[keep]
        return None

    hook = ProbeHook(engine, rows, lambda r: copy_src[r.clamp(min=0)].clamp(min=0), on_probe, need_loss=False)
    if total:
        td = engine_batch(ids, list(range(N)) + [-1] * (total - N), per_pass,
                           engine.engine_config.use_fused_kernels)
        run_engine(engine, td, hook, forward_only=True)
    if not last:
        return None
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    c = 0
    for b, m in zip(src.unique().tolist(), masks):  # each copy's score goes to every token it masked
        s, n = rows.start[b], rows.n[b]
        importance[b, s:s + n] = torch.where(m, shifts[c:c + m.shape[0], None], 0.0).sum(0)
        c += m.shape[0]
    return importance


def embedding_module(engine):
    """The first pipeline stage's embedding (``GPTModel.embedding``), None on other stages."""
    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(engine.module[0])
    return getattr(gpt, "embedding", None) if getattr(gpt, "pre_process", False) else None


def oar_g(engine, batch: AttributionBatch, rows: EngineRows, cfg: OARConfig, limits: PassLimits,
          seeds: torch.Tensor) -> torch.Tensor:
    """(B, L) OAR-G scores on every rank of the last pipeline stage (zeros elsewhere until the broadcast)."""
    from megatron.core import parallel_state as mpu

    mbs = micro_batch_rows(rows, limits, limits.rows)
    teacher = clean_pass(engine, rows, mbs)
    B = len(rows.n)
    total = fill_to_ranks(B, mbs)
    order = list(range(B)) + [0] * (total - B)
    row_ids = [b if k < B else -1 for k, b in enumerate(order)]
    seeds = seeds.long().cpu()

    def on_probe(row_t, probe, joint):
        r = row_t.tolist()
        J = vp_outcome_shift(teacher.get(r, probe), probe, joint)
        return torch.where(row_t.to(J.device) >= 0, J, torch.zeros_like(J))

    hook = ProbeHook(engine, rows, lambda r: r.clamp(min=0), on_probe, need_loss=True)

    # first stage: noisy embedding leaf per micro-batch, in schedule order (checked against the token ids)
    emb = embedding_module(engine)
    sp = bool(getattr(engine.tf_config, "sequence_parallel", False))
    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    scores: dict[int, torch.Tensor] = {}
    chunked_mb: dict[int, bool] = {}
    state = {"mb": 0}

    def add_noise(module, args, kwargs, out):
        k = state["mb"]
        state["mb"] += 1
        mb_rows = order[k * mbs:(k + 1) * mbs]
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        s_full = input_ids.shape[1]
        chunked = out.shape[0] != s_full  # sequence-parallel scatter inside the embedding: [s/tp, b, h]
        if chunked and not (sp and out.shape[0] * tp == s_full):
            raise RuntimeError(f"OAR-G: embedding output {tuple(out.shape)} for input {tuple(input_ids.shape)}")
        for i, b in enumerate(mb_rows):  # the schedule must hand us micro-batch k: check its tokens
            if not torch.equal(input_ids[i, :rows.n[b]].cpu(), rows.ids[b]):
                raise RuntimeError("OAR-G: embedding forward does not match the expected micro-batch order")
        mask = torch.zeros(len(mb_rows), s_full, dtype=torch.bool)
        for i, b in enumerate(mb_rows):
            if row_ids[k * mbs + i] >= 0:
                mask[i, :rows.n[b]] = rows.reasoning[b]
        # drawn on the embedding's device, like the FSDP path (same seeds, same generator kind: same noise)
        noise = reasoning_noise(mask.to(out.device), out.shape[-1], cfg.noise_std, seeds[mb_rows].to(out.device),
                                out.dtype)  # (b, s, h)
        noise = noise.transpose(0, 1)  # [s, b, h] like the embedding output
        if chunked:
            s_loc = out.shape[0]
            noise = noise[tp_rank * s_loc:(tp_rank + 1) * s_loc]
        chunked_mb[k] = chunked
        clean = out.detach()
        leaf = (clean + noise).requires_grad_(True)

        def grad_x_input(grad, clean=clean, k=k):
            acc = torch.promote_types(clean.dtype, torch.float32)
            scores[k] = (grad.to(acc) * clean.to(acc)).sum(-1).abs().float()  # [s(_local), b]

        leaf.register_hook(grad_x_input)
        return leaf

    handle = emb.register_forward_hook(add_noise, with_kwargs=True) if emb is not None else None
    try:
        if total:
            td = engine_batch([rows.ids[b] for b in order], row_ids, mbs, engine.engine_config.use_fused_kernels)
            with no_param_grads(engine), full_recompute(engine):
                run_engine(engine, td, hook, forward_only=False)
    finally:
        if handle is not None:
            handle.remove()

    from verl.utils.device import get_device_id

    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    if emb is not None:
        n_mb = total // mbs if total else 0
        if len(scores) != n_mb:
            raise RuntimeError(f"OAR-G: {len(scores)} embedding gradients for {n_mb} micro-batches")
        for k in range(n_mb):
            sc = scores[k]
            if chunked_mb[k]:  # sequence-parallel chunks -> the full sequence on every tensor-parallel rank
                parts = [torch.empty_like(sc) for _ in range(tp)]
                dist.all_gather(parts, sc.contiguous(), group=mpu.get_tensor_model_parallel_group())
                sc = torch.cat(parts, 0)
            sc = sc.cpu()
            for i, b in enumerate(order[k * mbs:(k + 1) * mbs]):
                if row_ids[k * mbs + i] < 0:
                    continue
                n, s0 = rows.n[b], rows.start[b]
                importance[b, s0:s0 + n] = torch.where(rows.reasoning[b], sc[:n, i], 0.0)
    if mpu.get_pipeline_model_parallel_world_size() > 1:  # first stage -> every stage of this pipeline
        buf = importance.to(get_device_id())
        dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_first_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        importance = buf.cpu()
    return importance
