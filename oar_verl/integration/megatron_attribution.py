"""OAR attribution through verl 0.9.1's Megatron engine (``actor.strategy=megatron``).

Everything runs through the engine's own forward machinery (``MegatronEngine.forward_backward_batch`` →
``forward_step`` → megatron-core's pipeline schedule → verl's ``gptmodel_forward_model_engine``), in the padded
(BSHD) layout, with the outcome probe read inside the engine's logits processor:

* the probe is handed to ``forward_step`` as its ``logits_processor_func`` (verl's top-k-distillation hook,
  ``distillation_use_topk=True, distillation_only=True``), which receives the **vocab-parallel** logits
  ``(b, s, V/tp)`` of each micro-batch on the last pipeline stage. Per-token probe inputs (weights over logit positions,
  AS-Joint targets) are looked up from the micro-batch's row ids and laid out with verl's own
  ``preprocess_bshd_engine``, exactly like the engine lays out its labels. The weighted mean of the raw logits is
  taken at the probe positions only (``(n_probe, V/tp)`` in fp32), and log-softmax, KL and AS-Joint log-probs are
  vocab-parallel (max / sum-exp / KL partial sums all-reduced over the tensor-parallel group with megatron-core's
  autograd-aware ``reduce_from_tensor_model_parallel_region``): the full vocabulary is never gathered on one rank.
* **OAR-P**: one forward-only pass over the clean rows (probe distributions kept on the last stage), then one pass over
  all masked copies in micro-batches of ``chunk_size`` (megatron-core pipelines them); the KL of each copy is computed
  in the logits processor against its clean row.
* **OAR-G**: a forward-only teacher pass, then one ``forward_backward_batch(forward_only=False)`` whose loss is
  ``J = KL(p0 ‖ p_noisy)`` (or φ0 − φ_noisy). A forward hook on the first stage's embedding (``GPTModel.embedding``,
  output ``[s, b, h]``) adds the seeded noise of :func:`oar_verl.core.gradient.reasoning_noise` on the reasoning
  positions and returns a detached leaf; a tensor hook on that leaf turns ``∂J/∂e`` into ``|⟨∂J/∂e_t, e_t⟩|`` per
  token during the backward (only ``(s, b)`` scores are kept). Every parameter is frozen for the pass, and the
  schedule's gradient finalisation (DP all-reduce / reduce-scatter of grad buffers), grad-sync and loss-scale
  callbacks are switched off for it, so no parameter gradient, grad-buffer content or optimizer state is created or
  touched. Sequence-parallel embedding chunks are all-gathered over the tensor-parallel group; the scores then go from
  the first to the last pipeline stage with one broadcast in each pipeline group.

The result is returned on the engine's collecting rank (``engine.is_mp_src_rank_with_outputs()``: tp0, last pipeline
stage, cp0) and ``None`` elsewhere, like ``compute_log_prob``'s outputs.

Data-parallel ranks issue equal collective counts: each method makes exactly two engine calls, and before each the
micro-batch count is all-reduced (max) over all ranks and short ranks top up with dummy rows whose results are dropped.

Layouts: tensor, pipeline and data parallelism, sequence parallelism; the engine's training layout may be packed
(``use_remove_padding=True``, THD) -- attribution switches the engine to its padded BSHD path for its own calls and
restores the setting after. Refused with :class:`MegatronLayoutError` (the message names the setting): context
parallelism, dynamic context parallelism, virtual pipeline stages, Megatron-FSDP, fused kernels, multi-token
prediction, ``calculate_per_token_loss``. ``algorithm.oar.prefix_cache`` does not apply (the engine has no key/value
cache path): OAR-P always runs the batched masked copies, with the same numbers.

Memory: the engine materialises the logits of a whole micro-batch, ``(b, s, V/tp)`` in the model dtype (as its own
log-prob pass does), so OAR-P's ``chunk_size`` and OAR-G's ``micro_batch_size`` bound the peak like
``infer_micro_batch_size_per_gpu`` does; the probe itself works on ``(n_probe, V/tp)`` fp32.

megatron-core is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from oar_verl.core.config import OARConfig
from oar_verl.core.gradient import reasoning_noise
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.perturbation import mask_blocks

__all__ = ["MegatronLayoutError", "megatron_layout_error", "check_megatron_layout", "megatron_token_importance"]


class MegatronLayoutError(NotImplementedError):
    """A Megatron parallel layout or engine setting that OAR attribution does not support (the message names it)."""


# ---------------------------------------------------------------------------------------------------------------------
# Supported layouts
# ---------------------------------------------------------------------------------------------------------------------


def megatron_layout_error(engine_config, *, mtp_enabled: bool = False, use_fused_kernels: bool | None = None,
                          tf_config=None) -> str | None:
    """Why OAR cannot run on a Megatron engine with this configuration, or None when it can.

    Args:
        engine_config: verl's ``McoreEngineConfig`` (``actor_rollout_ref.actor.megatron``), or any object / mapping
            with its attribute names.
        mtp_enabled: ``actor_rollout_ref.model.mtp.enable``.
        use_fused_kernels: ``actor_rollout_ref.model.use_fused_kernels`` (default: read from ``engine_config``).
        tf_config: the engine's megatron-core TransformerConfig, once built (checks ``calculate_per_token_loss``).
    """
    # verl's configs (McoreEngineConfig, OmegaConf DictConfig) and plain dicts all have .get
    get = (lambda k, d=None: engine_config.get(k, d)) if hasattr(engine_config, "get") else \
        (lambda k, d=None: getattr(engine_config, k, d))
    if use_fused_kernels is None:
        use_fused_kernels = bool(get("use_fused_kernels", False))
    key = "actor_rollout_ref.actor.megatron"
    if (get("context_parallel_size", 1) or 1) > 1:
        return (f"{key}.context_parallel_size={get('context_parallel_size')}: OAR attribution does not support "
                "context parallelism yet (set it to 1; use tensor/pipeline parallelism)")
    if get("dynamic_context_parallel", False):
        return f"{key}.dynamic_context_parallel=True: OAR attribution does not support dynamic context parallelism"
    vpp = get("virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        return (f"{key}.virtual_pipeline_model_parallel_size={vpp}: OAR attribution does not support virtual "
                "pipeline stages yet (set it to null)")
    if get("use_megatron_fsdp", False):
        return (f"{key}.use_megatron_fsdp=True: OAR attribution is not tested with Megatron-FSDP sharded parameters "
                "yet (use the default DDP / distributed optimizer)")
    if use_fused_kernels:
        return ("use_fused_kernels=True (actor_rollout_ref.model.use_fused_kernels): the fused Megatron forward "
                "bypasses the logits processor that OAR reads its probe from; set it to False")
    if mtp_enabled:
        return "actor_rollout_ref.model.mtp.enable=True: OAR attribution does not support multi-token prediction"
    if tf_config is not None and getattr(tf_config, "calculate_per_token_loss", False):
        return ("calculate_per_token_loss=True in the Megatron transformer config: OAR attribution needs the "
                "per-micro-batch loss regime (remove it from override_transformer_config)")
    return None


def check_megatron_layout(engine) -> None:
    """Raise :class:`MegatronLayoutError` if OAR cannot run on this (initialised) Megatron engine."""
    mtp = getattr(getattr(engine.model_config, "mtp", None), "enable", False)
    msg = megatron_layout_error(engine.engine_config, mtp_enabled=bool(mtp), tf_config=getattr(engine, "tf_config",
                                                                                             None))
    if msg is None and len(engine.module) > 1:
        msg = (f"the engine holds {len(engine.module)} model chunks (virtual pipeline stages): OAR attribution does "
               "not support virtual pipeline stages yet")
    if msg is not None:
        raise MegatronLayoutError(msg)


# ---------------------------------------------------------------------------------------------------------------------
# Rows: the AttributionBatch in the engine's unpadded row layout
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    """Each row's real tokens, which the engine lays out from position 0 (position ids 0..n-1).

    Attributes:
        start: (B,) first real column of each row in the AttributionBatch; n: (B,) real-token counts.
        ids / weight / target / reasoning: per row, the (n,) slices of input_ids, probe.logit_weight,
            probe.target_ids and reasoning_mask.
        joint: (B,) bool.
    """

    start: list[int]
    n: list[int]
    ids: list[torch.Tensor]
    weight: list[torch.Tensor]
    target: list[torch.Tensor]
    reasoning: list[torch.Tensor]
    joint: torch.Tensor


def _rows(batch: AttributionBatch) -> _Rows:
    am = batch.attention_mask.bool().cpu()
    B, L = am.shape
    n = am.sum(-1)
    start = torch.where(n > 0, am.int().argmax(-1), torch.zeros_like(n))
    col = torch.arange(L)[None, :]
    contiguous = am == ((col >= start[:, None]) & (col < (start + n)[:, None]))
    if not bool(contiguous.all()):
        raise ValueError("Megatron attribution needs each row's real tokens to be contiguous (left-padded prompt + "
                         "right-padded response)")
    if bool((n == 0).any()):
        raise ValueError("Megatron attribution got a row without tokens")
    pos = batch.position_ids.cpu()
    weight = batch.probe.logit_weight.float().cpu()
    if bool((weight[~am] != 0).any()):
        raise ValueError("probe weights on padding positions")
    ids, w, tgt, reas = [], [], [], []
    start_l, n_l = start.tolist(), n.tolist()
    for b in range(B):  # per row: slicing its real tokens
        s, e = start_l[b], start_l[b] + n_l[b]
        if not torch.equal(pos[b, s:e], torch.arange(n_l[b])):
            raise ValueError("Megatron attribution needs position ids 0..n-1 on each row's real tokens (the engine "
                             "builds them so)")
        ids.append(batch.input_ids[b, s:e].long().cpu())
        w.append(weight[b, s:e])
        tgt.append(batch.probe.target_ids[b, s:e].long().cpu())
        reas.append(batch.reasoning_mask[b, s:e].bool().cpu())
    return _Rows(start_l, n_l, ids, w, tgt, reas, batch.probe.joint.bool().cpu())


# ---------------------------------------------------------------------------------------------------------------------
# Vocab-parallel probe maths (last pipeline stage, inside the engine's logits processor)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Probe:
    """Probe read-out of b rows on one tensor-parallel rank.

    Attributes:
        zbar: (b, V_local) fp32, this rank's vocabulary shard of the weighted mean raw logits Σ_k w_k z_k.
        lse: (b,) logsumexp of zbar over the FULL vocabulary (identical on every tensor-parallel rank).
        phi: (b,) AS-Joint score (0 on other rows), identical on every tensor-parallel rank.
    The probe distribution is log P = zbar − lse.
    """

    zbar: torch.Tensor
    lse: torch.Tensor
    phi: torch.Tensor


@dataclass
class _Clean:
    """A stored (detached) clean / teacher probe: zbar, lse, p = exp(zbar − lse) (local shard), psum = Σ_v p over
    the full vocabulary (1 up to rounding), phi."""

    zbar: torch.Tensor
    lse: torch.Tensor
    p: torch.Tensor
    psum: torch.Tensor
    phi: torch.Tensor


def _tp_reduce(x: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the tensor-parallel group; backward is the identity (megatron-core semantics).

    The identity backward is exact only when everything computed from the reduced value is identical on every rank,
    so the vocab-parallel maths below reduces local partial sums first and combines the reduced values after.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def _vp_logsumexp(z: torch.Tensor) -> torch.Tensor:
    """logsumexp over a vocabulary split over the tensor-parallel group: z (..., V_local) fp32 -> (...) replicated."""
    from megatron.core import parallel_state as mpu

    m = z.detach().amax(-1)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m + _tp_reduce((z - m[..., None]).exp().sum(-1)).log()


def _vocab_lo(v_local: int) -> int:
    """Global id of this tensor-parallel rank's first vocabulary column."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank() * v_local


def _real_columns(v_local: int, true_vocab: int | None) -> int:
    """Local vocabulary columns that are real tokens (a vocabulary padded for TP has extra columns at the end)."""
    if true_vocab is None:
        return v_local
    return max(0, min(v_local, true_vocab - _vocab_lo(v_local)))


def _probe_from_vp_logits(logits: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, joint: torch.Tensor,
                          true_vocab: int | None) -> _Probe:
    """Outcome probe of a micro-batch from vocab-parallel logits (oar_verl.core.probes.probe_from_logits, split
    over the vocabulary).

    Args:
        logits: (b, s, V_local) the engine's logits (vocab-parallel, last stage).
        weight: (b, s) probe weight per logit position (each row sums to 1).
        target: (b, s) token each position predicts (AS-Joint).
        joint: (b,) bool.
    """
    b, _, v_local = logits.shape
    v_real = _real_columns(v_local, true_vocab)
    r, j = (weight != 0).nonzero(as_tuple=True)
    z = logits[r, j, :v_real].float()  # (n_probe, V_real_local): only the probe positions, in fp32
    w = weight[r, j].to(z.dtype)
    zbar = torch.zeros(b, z.shape[-1], dtype=z.dtype, device=z.device).index_add(0, r, w[:, None] * z)
    lse = _vp_logsumexp(zbar)
    phi = torch.zeros(b, dtype=z.dtype, device=z.device)
    if bool(joint.any()):  # per-position log-softmax only when a row uses AS-Joint
        local_t = target[r, j] - _vocab_lo(v_local)
        inside = (local_t >= 0) & (local_t < z.shape[-1])
        picked = z.gather(-1, local_t.clamp(0, max(z.shape[-1] - 1, 0))[:, None]).squeeze(-1)
        tok_logp = _tp_reduce(torch.where(inside, picked, torch.zeros_like(picked))) - _vp_logsumexp(z)
        phi = torch.zeros(b, dtype=z.dtype, device=z.device).index_add(0, r, w * tok_logp)
        phi = torch.where(joint, phi, torch.zeros_like(phi))
    return _Probe(zbar, lse, phi)


def _clean(probe: _Probe) -> _Clean:
    zbar, lse = probe.zbar.detach(), probe.lse.detach()
    p = (zbar - lse[:, None]).exp()
    return _Clean(zbar, lse, p, _tp_reduce(p.sum(-1)), probe.phi.detach())


def _shift(clean: _Clean, pert: _Probe, joint: torch.Tensor) -> torch.Tensor:
    """(b,) KL(P_clean ‖ P_pert) or φ_clean − φ_pert on AS-Joint rows, identical on every tensor-parallel rank.

    KL = Σ_v p_v (log p_v − log q_v) = Σ_v p_v (zbar0_v − zbar_v) + (Σ_v p_v)(lse − lse0): one reduced sum of local
    terms plus replicated values, so the gradient with respect to the local logits is exact on every rank.
    """
    kl = _tp_reduce((clean.p * (clean.zbar - pert.zbar)).sum(-1)) + clean.psum * (pert.lse - clean.lse)
    return torch.where(joint, clean.phi - pert.phi, kl)


# ---------------------------------------------------------------------------------------------------------------------
# The engine call
# ---------------------------------------------------------------------------------------------------------------------

_ROW = "oar_row"  # (N,) long: index into the caller's table; -1 = filler row (result dropped)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _engine_batch(ids: list[torch.Tensor], row_ids: list[int], micro_batch_size: int, use_fused_kernels: bool):
    """A TensorDict in the layout of verl's ``compute_log_prob`` inputs (nested, unpadded rows): token ids, a
    (bool) loss mask the engine only counts, and the row ids; the BSHD path builds position ids 0..n-1 itself.
    Probe inputs are looked up per micro-batch from the row ids, so OAR-P's copies cost 9 bytes per token."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    td = TensorDict({
        "input_ids": _nested(ids),
        "loss_mask": _nested([torch.ones(len(x), dtype=torch.bool) for x in ids]),
        _ROW: torch.tensor(row_ids, dtype=torch.long),
    }, batch_size=[len(ids)])
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size, temperature=1.0,
                         use_fused_kernels=use_fused_kernels, calculate_entropy=False, distillation_use_topk=True,
                         distillation_only=True, use_remove_padding=False)
    return td


class _ProbeHook:
    """The engine's ``loss_function``: called as the logits processor (``student_logits=``, ``data=``) on the last
    stage, and as the loss (``model_output=``, ``data=``, ``dp_group=``) right after, for the same micro-batch."""

    def __init__(self, engine, rows: _Rows, source_of, on_probe, need_loss: bool):
        self.engine = engine
        self.rows = rows
        self.source_of = source_of  # row ids (b,) long (cpu) -> (b,) long: the _Rows row each one reads its probe from
        self.on_probe = on_probe  # (row ids (b,) long, _Probe, joint (b,) bool) -> per-row J (b,) or None
        self.need_loss = need_loss
        self.pending: torch.Tensor | None = None
        hf = getattr(engine.model_config, "hf_config", None)
        self.true_vocab = getattr(hf, "vocab_size", None)

    def __call__(self, **kw):
        if "student_logits" in kw:
            return self._process(kw["student_logits"], kw["data"])
        loss, self.pending = self.pending, None
        if loss is None:  # forward-only passes: the engine needs a scalar
            loss = torch.zeros((), device=kw["data"]["input_ids"].device)
        return loss, {}

    def _process(self, logits: torch.Tensor, data) -> dict:
        from verl.models.mcore.util import preprocess_bshd_engine
        from verl.utils import tensordict_utils as tu

        forced = tu.get_non_tensor_data(data=data, key="forced_max_seqlen", default=None)
        fp8 = getattr(self.engine.tf_config, "fp8", None) in ("e4m3", "hybrid")
        rows = data[_ROW]
        src = self.source_of(rows.cpu()).tolist()
        # lay the per-token probe inputs out exactly as the engine lays out its labels
        weight, target = (preprocess_bshd_engine(_nested([getattr(self.rows, f)[b] for b in src]), pre_process=True,
                                                 use_fp8_padding=fp8, forced_max_seqlen=forced)[0]
                          for f in ("weight", "target"))
        if weight.shape != logits.shape[:2]:
            raise RuntimeError(f"OAR probe layout {tuple(weight.shape)} does not match the engine's logits "
                               f"{tuple(logits.shape[:2])}")
        joint = (self.rows.joint[src] & (rows.cpu() >= 0)).to(logits.device)
        probe = _probe_from_vp_logits(logits, weight.to(logits.device), target.to(logits.device), joint,
                                      self.true_vocab)
        J = self.on_probe(rows, probe, joint)
        if self.need_loss:
            self.pending = J.sum()
        return {}


@contextlib.contextmanager
def _padded_layout(engine) -> Iterator[None]:
    """Run the engine's padded (BSHD) path for attribution calls, whatever its training layout."""
    cfg = engine.engine_config
    old = cfg.use_remove_padding
    object.__setattr__(cfg, "use_remove_padding", False)  # frozen verl config field: attribution-local override
    try:
        yield
    finally:
        object.__setattr__(cfg, "use_remove_padding", old)


@contextlib.contextmanager
def _no_param_grads(engine) -> Iterator[None]:
    """Frozen parameters and no gradient finalisation for a forward-backward whose only leaf is the embedding output.

    The schedule's ``finalize_model_grads_func`` (DP all-reduce / reduce-scatter of the grad buffers, embedding and
    layer-norm grad sync), ``grad_sync_func`` and ``grad_scale_func`` (loss scaling) are switched off for the call and
    restored after, so grad buffers, optimizer state and the loss scaler are not touched.
    """
    from megatron.core.utils import get_model_config

    params = [p for m in engine.module for p in m.parameters()]
    flags = [p.requires_grad for p in params]
    configs = {id(c): c for c in (get_model_config(m) for m in engine.module)}.values()
    names = ("finalize_model_grads_func", "grad_sync_func", "grad_scale_func")
    saved = [(c, n, getattr(c, n, None)) for c in configs for n in names]
    try:
        for p in params:
            p.requires_grad_(False)
        for c, n, _ in saved:
            setattr(c, n, None)
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        for c, n, v in saved:
            setattr(c, n, v)


def _max_over_ranks(value: int) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    from verl.utils.device import get_device_id

    t = torch.tensor([value], dtype=torch.long, device=get_device_id())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _fill(n: int, mbs: int) -> int:
    """Rows to run: ``n`` topped up so that every rank runs the same number of micro-batches (max over ranks)."""
    n_mb = _max_over_ranks(math.ceil(n / mbs))
    if n_mb > 0 and n == 0:
        raise ValueError("Megatron attribution: this rank has no rows but others do; the trainer must give every "
                         "data-parallel rank at least one row")
    return n_mb * mbs


@dataclass
class _Table:
    """Per-row clean probes kept on the last pipeline stage, keyed by row id."""

    rows: dict[int, _Clean] = field(default_factory=dict)

    def put(self, rows: list[int], probe: _Probe) -> None:
        clean = _clean(probe)  # (tensor-parallel collective: every rank of the stage runs it)
        for i, r in enumerate(rows):
            if r >= 0:
                self.rows[r] = _Clean(clean.zbar[i], clean.lse[i], clean.p[i], clean.psum[i], clean.phi[i])

    def get(self, rows: list[int], like: _Probe) -> _Clean:
        """The clean probes of ``rows``; filler rows (-1) get the live probe itself (a zero shift)."""
        live = _clean(like)
        out = [self.rows[r] if r >= 0 else _Clean(live.zbar[i], live.lse[i], live.p[i], live.psum[i], live.phi[i])
               for i, r in enumerate(rows)]
        return _Clean(*(torch.stack([getattr(o, f) for o in out]) for f in ("zbar", "lse", "p", "psum", "phi")))


def _run(engine, td, hook: _ProbeHook, forward_only: bool) -> None:
    with _padded_layout(engine):
        if forward_only:
            engine.infer_batch(td, loss_function=hook)
        else:
            with torch.enable_grad():
                engine.forward_backward_batch(td, hook, forward_only=False)


def _clean_pass(engine, rows: _Rows, mbs: int) -> _Table:
    """Forward-only pass over the clean rows; their probes stay on the last stage."""
    B = len(rows.n)
    total = _fill(B, mbs)
    order = list(range(B)) + [0] * (total - B)
    ids = [-1 if k >= B else b for k, b in enumerate(order)]
    table = _Table()

    def on_probe(row_t, probe, joint):
        table.put(row_t.tolist(), probe)
        return None

    hook = _ProbeHook(engine, rows, lambda r: r.clamp(min=0), on_probe, need_loss=False)  # fillers: row 0
    if total:
        td = _engine_batch([rows.ids[b] for b in order], ids, mbs, engine.engine_config.use_fused_kernels)
        _run(engine, td, hook, forward_only=True)
    return table


def _oar_p(engine, batch: AttributionBatch, rows: _Rows, cfg: OARConfig, mask_token_id: int) -> torch.Tensor | None:
    from megatron.core import parallel_state as mpu

    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    clean = _clean_pass(engine, rows, cfg.micro_batch_size)
    # the masked copies, as the core builds them (oar_verl.core.perturbation): one copy per block of mask_span
    # consecutive reasoning tokens
    reasoning = batch.reasoning_mask.bool().cpu()
    blocks = mask_blocks(reasoning, cfg.mask_span)
    rank = reasoning.long().cumsum(-1) - 1
    src, first = (reasoning & (rank % cfg.mask_span == 0)).nonzero().unbind(1)
    N = int(src.shape[0])
    total = _fill(N, cfg.chunk_size)
    src_l, first_l = src.tolist(), first.tolist()
    ids, masks = [], []
    for c in range(total):  # per copy (the engine needs one token row per copy)
        b = src_l[c] if c < N else 0
        s, n = rows.start[b], rows.n[b]
        if c < N:
            blk = blocks[b, s:s + n]
            m = blk == blocks[b, first_l[c]]
            masks.append(m)
            ids.append(rows.ids[b].masked_fill(m, mask_token_id))
        else:
            ids.append(rows.ids[b])
    copy_src = torch.tensor(src_l + [-1] * (total - N), dtype=torch.long)
    shifts = torch.zeros(N, dtype=torch.float32)

    def on_probe(row_t, probe, joint):
        r = row_t.cpu()
        base = clean.get(copy_src[r.clamp(min=0)].masked_fill(r < 0, -1).tolist(), probe)
        s = _shift(base, probe, joint).float().cpu()
        keep = r >= 0
        shifts[r[keep]] = s[keep]
        return None

    hook = _ProbeHook(engine, rows, lambda r: copy_src[r.clamp(min=0)].clamp(min=0), on_probe, need_loss=False)
    if total:
        td = _engine_batch(ids, list(range(N)) + [-1] * (total - N), cfg.chunk_size,
                           engine.engine_config.use_fused_kernels)
        _run(engine, td, hook, forward_only=True)
    if not last:
        return None
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for c in range(N):  # per copy: its score goes to every token it masked
        b = src_l[c]
        cols = masks[c].nonzero().squeeze(1) + rows.start[b]
        importance[b, cols] = shifts[c]
    return importance


def _embedding_module(engine):
    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(engine.module[0])
    return getattr(gpt, "embedding", None) if getattr(gpt, "pre_process", False) else None


def _oar_g(engine, batch: AttributionBatch, rows: _Rows, cfg: OARConfig, seeds: torch.Tensor) -> torch.Tensor:
    """(B, L) OAR-G scores on every rank of the last pipeline stage (zeros elsewhere until the broadcast)."""
    from megatron.core import parallel_state as mpu

    mbs = cfg.micro_batch_size
    teacher = _clean_pass(engine, rows, mbs)
    B = len(rows.n)
    total = _fill(B, mbs)
    order = list(range(B)) + [0] * (total - B)
    row_ids = [b if k < B else -1 for k, b in enumerate(order)]
    seeds = seeds.long().cpu()

    def on_probe(row_t, probe, joint):
        r = row_t.tolist()
        J = _shift(teacher.get(r, probe), probe, joint)
        return torch.where(row_t.to(J.device) >= 0, J, torch.zeros_like(J))

    hook = _ProbeHook(engine, rows, lambda r: r.clamp(min=0), on_probe, need_loss=True)

    # first stage: noisy embedding leaf per micro-batch, in schedule order (checked against the token ids)
    emb = _embedding_module(engine)
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
            td = _engine_batch([rows.ids[b] for b in order], row_ids, mbs, engine.engine_config.use_fused_kernels)
            with _no_param_grads(engine):
                _run(engine, td, hook, forward_only=False)
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


def megatron_token_importance(engine, batch: AttributionBatch, cfg: OARConfig, *, mask_token_id: int | None,
                              seeds: torch.Tensor | None) -> torch.Tensor | None:
    """OAR importance of the batch's reasoning tokens through a verl Megatron engine.

    Call under ``engine.eval_mode()`` on every rank of the actor mesh (all tensor/pipeline ranks of a data-parallel
    group hold the same batch, as verl dispatches ``compute_log_prob``).

    Args:
        engine: verl's ``MegatronEngineWithLMHead``, initialised.
        batch: AttributionBatch (B, L), on any device; each row's real tokens contiguous with position ids 0..n-1
            (verl's layout: left-padded prompt + right-padded response).
        cfg: OARConfig (``prefix_cache`` does not apply: the Megatron path always runs the batched masked copies).
        mask_token_id: OAR-P mask token (required for perturbation).
        seeds: (B,) int64 OAR-G noise seeds (required for gradient).

    Returns:
        (B, L) float32 importance (0 off the reasoning tokens) on the collecting rank
        (``engine.is_mp_src_rank_with_outputs()``), None on every other rank.

    Raises:
        MegatronLayoutError: a layout OAR does not support (context parallelism, virtual pipeline, fused kernels,
            multi-token prediction, per-token-loss regime).
    """
    check_megatron_layout(engine)
    if cfg.mode == "perturbation":
        if mask_token_id is None:
            raise ValueError("OAR-P needs a mask token: set algorithm.oar.mask_token_id or give the tokenizer a pad "
                             "token")
    elif seeds is None:
        raise ValueError("OAR-G needs per-sequence noise seeds (see oar_verl.core.gradient.sequence_seeds)")
    rows = _rows(batch)
    if cfg.mode == "perturbation":
        importance = _oar_p(engine, batch, rows, cfg, int(mask_token_id))
    else:
        importance = _oar_g(engine, batch, rows, cfg, seeds)
    if not engine.is_mp_src_rank_with_outputs():
        return None
    return importance
