"""The plumbing between OAR and verl's Megatron engine: rows in the engine's layout, engine batches, the probe hook
the engine calls as its logits processor and loss, and the settings attribution switches for its own calls.

Everything runs through the engine's own forward machinery (``MegatronEngine.forward_backward_batch`` →
``forward_step`` → megatron-core's pipeline schedule → verl's ``gptmodel_forward_model_engine``) in the padded (BSHD)
layout. The probe is handed to ``forward_step`` as its ``logits_processor_func`` (verl's top-k-distillation hook,
``distillation_use_topk=True, distillation_only=True``), which receives the vocab-parallel logits of each micro-batch on
the last pipeline stage; per-token probe inputs are looked up from the micro-batch's row ids and laid out with verl's
own ``preprocess_bshd_engine``, exactly as the engine lays out its labels. megatron-core is imported lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.base import frozen_parameters
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.backends.collectives import max_over_ranks
from oar_verl.integration.megatron.vocab_parallel import CleanProbe, VPProbe, detach_clean, probe_from_vp_logits


@dataclass(frozen=True)
class EngineRows:
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


def engine_rows(batch: AttributionBatch) -> EngineRows:
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
    return EngineRows(start_l, n_l, ids, w, tgt, reas, batch.probe.joint.bool().cpu())




_ROW = "oar_row"  # (N,) long: index into the caller's table; -1 = filler row (result dropped)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def engine_batch(ids: list[torch.Tensor], row_ids: list[int], micro_batch_size: int, use_fused_kernels: bool):
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


class ProbeHook:
    """The engine's ``loss_function``: called as the logits processor (``student_logits=``, ``data=``) on the last
    stage, and as the loss (``model_output=``, ``data=``, ``dp_group=``) right after, for the same micro-batch."""

    def __init__(self, engine, rows: EngineRows, source_of, on_probe, need_loss: bool):
        self.engine = engine
        self.rows = rows
        # row ids (b,) long (cpu) -> (b,) long: the EngineRows row each one reads its probe from
        self.source_of = source_of
        self.on_probe = on_probe  # (row ids (b,) long, VPProbe, joint (b,) bool) -> per-row J (b,) or None
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
        probe = probe_from_vp_logits(logits, weight.to(logits.device), target.to(logits.device), joint,
                                     self.true_vocab)
        J = self.on_probe(rows, probe, joint)
        if self.need_loss:
            self.pending = J.sum()
        return {}


@contextlib.contextmanager
def padded_layout(engine) -> Iterator[None]:
    """Run the engine's padded (BSHD) path for attribution calls, whatever its training layout."""
    cfg = engine.engine_config
    old = cfg.use_remove_padding
    object.__setattr__(cfg, "use_remove_padding", False)  # frozen verl config field: attribution-local override
    try:
        yield
    finally:
        object.__setattr__(cfg, "use_remove_padding", old)


@contextlib.contextmanager
def no_param_grads(engine) -> Iterator[None]:
    """Frozen parameters and no gradient finalisation for a forward-backward whose only leaf is the embedding output.

    The schedule's ``finalize_model_grads_func`` (DP all-reduce / reduce-scatter of the grad buffers, embedding and
    layer-norm grad sync), ``grad_sync_func`` and ``grad_scale_func`` (loss scaling) are switched off for the call and
    restored after, so grad buffers, optimizer state and the loss scaler are not touched.
    """
    from megatron.core.utils import get_model_config

    configs = {id(c): c for c in (get_model_config(m) for m in engine.module)}.values()
    names = ("finalize_model_grads_func", "grad_sync_func", "grad_scale_func")
    saved = [(c, n, getattr(c, n, None)) for c in configs for n in names]
    try:
        for c, n, _ in saved:
            setattr(c, n, None)
        with frozen_parameters(p for m in engine.module for p in m.parameters()):
            yield
    finally:
        for c, n, v in saved:
            setattr(c, n, v)


def micro_batch_rows(rows: EngineRows, limits: PassLimits, cap: int | None) -> int:
    """Rows (or masked copies, as long as their rows) per engine micro-batch under the token budget.

    The engine pads a micro-batch to its longest row, so rows × the longest sequence of any rank must fit; every rank
    computes the same number (the longest is all-reduced), as :func:`fill_to_ranks` needs.
    """
    longest = max_over_ranks(max(rows.n, default=1))
    n = max(1, limits.tokens // max(longest, 1))
    return min(n, cap) if cap is not None else n


@contextlib.contextmanager
def full_recompute(engine) -> Iterator[None]:
    """The engine's full activation recomputation for an attribution backward, with eval numerics.

    megatron-core's ``TransformerBlock`` recomputes its layers when ``recompute_granularity == "full"`` and its own
    ``training`` flag is set; dropout reads the layers' flags. Only the blocks' flags are raised, and restored after.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock

    blocks = [m for chunk in engine.module for m in chunk.modules()
              if isinstance(m, TransformerBlock) and getattr(m.config, "recompute_granularity", None) == "full"]
    saved = [m.training for m in blocks]
    try:
        for m in blocks:
            m.training = True
        yield
    finally:
        for m, flag in zip(blocks, saved):
            m.training = flag


@dataclass
class CleanTable:
    """Per-row clean probes kept on the last pipeline stage, keyed by batch row (the engine's
    :class:`~oar_verl.core.backends.base.ProbeTable`)."""

    rows: dict[int, CleanProbe] = field(default_factory=dict)

    def put(self, rows: torch.Tensor, probe: VPProbe) -> None:
        clean = detach_clean(probe)  # (tensor-parallel collective: every rank of the stage runs it)
        for i, r in enumerate(rows.tolist()):
            self.rows[r] = CleanProbe(clean.zbar[i], clean.lse[i], clean.p[i], clean.psum[i], clean.phi[i])

    def get(self, rows: torch.Tensor) -> CleanProbe:
        out = [self.rows[r] for r in rows.tolist()]
        return CleanProbe(*(torch.stack([getattr(o, f) for o in out]) for f in ("zbar", "lse", "p", "psum", "phi")))


def run_engine(engine, td, hook: ProbeHook, forward_only: bool) -> None:
    """One engine call over ``td`` (forward-only, or forward-backward with the hook's loss), in the padded layout."""
    with padded_layout(engine):
        if forward_only:
            engine.infer_batch(td, loss_function=hook)
        else:
            with torch.enable_grad():
                engine.forward_backward_batch(td, hook, forward_only=False)
