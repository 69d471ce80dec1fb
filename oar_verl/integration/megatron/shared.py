"""verl's Megatron old-log-prob pass with a one-backward method read from it (``algorithm.oar.shared_forward``;
docs/method.md §14).

verl's ``compute_log_prob`` runs ``engine.infer_batch``: megatron-core's forward-only schedule under ``no_grad``. For
one call the worker runs the same micro-batches through the engine's forward-backward schedule instead
(``forward_backward_batch(forward_only=False)``, every parameter frozen and the gradient finalisation off, as the
backend's own backward passes run), so the schedule carries one backward per micro-batch, across pipeline stages:

* the first stage's embedding output becomes a leaf that requires grad; its gradient is turned into the method's
  projection and stored by batch position (under sequence parallelism each tensor-parallel rank its own chunk);
* the last stage's output layer keeps the probe positions' vocab-parallel logits with their graph and hands verl the
  logits detached, so verl's log-probs and entropies are computed from the same values as in its own pass, without a
  graph; the probe is read there and the method's loss (one column) is what verl's loss call returns to the schedule.

Positions are mapped by laying each row's batch positions out with verl's own ``preprocess_thd_engine`` /
``preprocess_bshd_engine`` (the packed or padded layout the engine runs), checked against the embedding's input ids.
A method with several loss columns (fisher with ``fisher_outcomes + fisher_sketches > 1``) needs as many backwards and
keeps the separate path (:func:`megatron_shared_error`). Conservative's pass runs under its propagation rules
(:mod:`.rules`: hooks that keep every forward value, so verl's log-probs are unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from oar_verl.core.backends.patching import patched_attributes
from oar_verl.core.backends.shared import ForwardLayout, SharedTarget, batch_columns, probe_index
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.attribution import METHODS, pass_limits
from oar_verl.core.methods.contract import MethodInputs
from oar_verl.integration.fields import ROW_FIELD
from oar_verl.integration.megatron.backend import MegatronBackend, embedding_module
from oar_verl.integration.megatron.engine import full_recompute, no_param_grads
from oar_verl.integration.megatron.rules import megatron_rules
from oar_verl.integration.megatron.vocab_parallel import probe_from_vp_logits


def megatron_shared_error(cfg, *, fused_kernels: bool = False, recomputes: bool = False,
                          tokens: tuple[int, int] = (0, 0)) -> str | None:
    """Why verl's Megatron old-log-prob pass cannot carry ``cfg``'s method (the worker then attributes after it, in
    the same call), or None.

    megatron-core's schedule runs one backward per micro-batch, so a method needs one loss column. The backward keeps
    the pass's activations as the update keeps its own (or recomputes them, as the engine's settings say); a pass
    whose micro-batches hold more tokens (``tokens``: the most a pass's micro-batch holds, the update's) would need
    more activation memory than the training step unless the engine recomputes every layer (``recomputes``).
    """
    if fused_kernels:
        return "use_fused_kernels=true (the fused forward computes no logits)"
    if METHODS.get(cfg.mode).shared is None:
        return (f"{cfg.prefix}.mode={cfg.mode} reads only its clean teachers from the pass, which this engine's "
                "schedule does not hand over")
    columns = METHODS.get(cfg.mode).shared_columns(cfg)
    if columns > 1:
        return (f"{cfg.prefix}.mode={cfg.mode} reads {columns} backwards per row here (fisher: fisher_outcomes + "
                "fisher_sketches); the Megatron schedule runs one per micro-batch")
    held, update = tokens
    if held > update and not recomputes:
        return (f"its micro-batches hold up to {held} tokens, the update's {update}: a backward through them would "
                "keep more activations than the training step (set actor_rollout_ref.rollout."
                "log_prob_max_token_len_per_gpu / log_prob_micro_batch_size_per_gpu to at most the actor's ppo_* "
                "values, or the engine's full recompute: actor_rollout_ref.actor.megatron."
                "override_transformer_config.recompute_granularity=full)")
    return None


def _to_device(x: torch.Tensor) -> torch.Tensor:
    from verl.utils.device import get_device_id

    return x.to(get_device_id())


class MegatronSharedAttribution:
    """A one-column clean-point method's scores gathered over the micro-batches of one engine call (see the module
    docstring). ``result`` and ``choices`` as :class:`~oar_verl.core.backends.shared.SharedAttribution`'s.

    Args:
        backend: verl's Megatron engine as a :class:`~oar_verl.integration.megatron.backend.MegatronBackend` (its
            layout checked; the mask operator reads its embedding table, the scores are shared over its stages).
        batch: the attributed rows.
        make: (backend) -> the method's :class:`~oar_verl.core.backends.shared.SharedTarget` (``columns`` == 1) over
            the engine's :class:`~oar_verl.integration.megatron.backend.MegatronBackend`; built at the first
            micro-batch, inside verl's ``eval_mode`` (weights loaded: the mask operator may read the embedding table).
    """

    def __init__(self, backend: MegatronBackend, batch: AttributionBatch,
                 make: Callable[[MegatronBackend], SharedTarget]):
        from megatron.core import parallel_state as mpu

        engine = backend.engine
        self.engine, self.backend, self.make = engine, backend, make
        self._target: SharedTarget | None = None
        self.batch = batch
        B, L = batch.input_ids.shape
        self.L = L
        am = batch.attention_mask.bool().cpu()  # each row's real tokens, contiguous: first column and count
        self._start, self._lengths = am.int().argmax(-1), am.sum(-1)
        self._flat_ids = batch.input_ids.reshape(-1).cpu().long()  # read by every micro-batch's checks
        self.projections = torch.zeros(B, 1, L, dtype=torch.float32)
        self.weights = torch.zeros(B, 1, dtype=torch.float32)
        self.covered = torch.zeros(B, dtype=torch.bool)
        self.choices: list[tuple[int, float]] = []
        self.tp, self.tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.sp = bool(getattr(engine.tf_config, "sequence_parallel", False)) and self.tp > 1
        self.recomputes = getattr(engine.tf_config, "recompute_granularity", None) == "full"
        hf = getattr(engine.model_config, "hf_config", None)
        self.true_vocab = getattr(hf, "vocab_size", None)
        self._micro_batch: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows (n,), codes (b, s)) running now
        self._pending: torch.Tensor | None = None

    @property
    def target(self) -> SharedTarget:
        if self._target is None:
            target = self.make(self.backend)
            if target.columns != 1:
                raise ValueError("the Megatron old-log-prob pass runs one backward per micro-batch; this method needs "
                                 f"{target.columns}")
            self._target = target
        return self._target

    # ---- the layout of one micro-batch -------------------------------------------------------------------------------

    def _codes(self, micro_batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (n,) long: the micro-batch's batch rows; codes (b, s) long: batch flat position + 1 of every position
        of the engine's layout, 0 on padding), after checking the rows are the attributed rows, whole."""
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
        from verl.utils import tensordict_utils as tu

        rows = micro_batch[ROW_FIELD].cpu().long()
        ids = micro_batch["input_ids"]
        lengths = ids.offsets().diff().cpu().long()
        start = self._start
        if not bool((lengths == self._lengths[rows]).all()):
            raise RuntimeError("oar: a micro-batch of the Megatron old-log-prob pass does not hold the rows being "
                               "attributed whole (its rows' lengths differ from the batch's prompts and responses)")
        codes = [rows[i] * self.L + start[rows[i]] + torch.arange(int(n)) + 1 for i, n in enumerate(lengths.tolist())]
        nested = torch.nested.as_nested_tensor(codes, layout=torch.jagged)
        cfg = self.engine.engine_config
        fp8 = getattr(self.engine.tf_config, "fp8", None) in ("e4m3", "hybrid")
        if cfg.use_remove_padding:
            bucket = cfg.pad_to_length_bucket if getattr(cfg, "pad_to_length", False) else None
            laid = preprocess_thd_engine(nested, pre_process=True, use_fp8_padding=fp8, pad_to_length_bucket=bucket)[0]
        else:
            forced = tu.get_non_tensor_data(data=micro_batch, key="forced_max_seqlen", default=None)
            laid = preprocess_bshd_engine(nested, pre_process=True, use_fp8_padding=fp8, forced_max_seqlen=forced)[0]
        laid = laid.cpu().long()
        if not torch.equal(self._flat_ids[laid[laid > 0] - 1], ids.values().cpu().long()):
            raise RuntimeError("oar: a micro-batch of the Megatron old-log-prob pass does not hold the rows being "
                               "attributed token for token")
        return rows, laid

    # ---- the hooks -------------------------------------------------------------------------------------------------

    def _at_embedding(self, module, args, kwargs, out):
        """First stage: the embedding output [s, b, h] ([s/tp, b, h] under sequence parallelism) as a leaf whose
        gradient is projected and stored by batch position."""
        rows, codes = self._micro_batch
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        real = codes > 0
        if tuple(input_ids.shape) != tuple(codes.shape) or not torch.equal(input_ids.cpu().long()[real],
                                                                           self._flat_ids[codes[real] - 1]):
            raise RuntimeError(f"oar: the Megatron embedding received input ids {tuple(input_ids.shape)} laid out "
                               f"otherwise than verl's layout of the micro-batch {tuple(codes.shape)}")
        at = codes.t()  # [s, b] like the embedding output
        if out.shape[0] != at.shape[0]:  # this tensor-parallel rank's sequence-parallel chunk
            s = out.shape[0]
            at = at[self.tp_rank * s:(self.tp_rank + 1) * s]
        clean = out.detach()
        leaf = clean.clone().requires_grad_(True)

        def project(grad, clean=clean, at=at):
            p = self.target.project(grad.transpose(0, 1), clean.transpose(0, 1)).float().cpu()  # (b, s)
            codes_bs = at.t()
            real = codes_bs > 0
            self.projections.view(-1)[codes_bs[real] - 1] = p[real]

        leaf.register_hook(project)
        return leaf

    def _at_output(self, module, args, out):
        """Last stage: the probe positions' vocab-parallel logits kept with their graph, the method's loss formed;
        verl gets the logits [s, b, V/tp] detached (its log-probs: the same values, no graph)."""
        logits = out[0] if isinstance(out, tuple) else out
        rows, codes = self._micro_batch
        spec = self.target.batch.probe  # the probe the method reads (conservative: every row's as φ)
        at = codes.reshape(-1)  # flat [b·s] order: each sequence's positions together (probe_index needs it)
        flat = (at > 0).nonzero().squeeze(1)
        pos = at[flat] - 1
        slot_of = torch.full((self.batch.input_ids.shape[0],), -1, dtype=torch.long)
        slot_of[rows] = torch.arange(rows.shape[0])
        layout = ForwardLayout(rows, flat, slot_of[pos // self.L], pos // self.L, pos % self.L)
        index, w = probe_index(layout, spec.logit_weight.cpu())
        targets = spec.target_ids.cpu()[rows[:, None], batch_columns(layout, index)]
        device = logits.device
        b, n_pos = codes.shape
        index = (index % n_pos) * b + index // n_pos  # into the logits' [s·b] order
        kept = logits.reshape(-1, logits.shape[-1])[index.to(device)]  # (n, K, V/tp): a copy, before verl's div_
        probe = probe_from_vp_logits(kept, w.to(device), targets.to(device), spec.joint.cpu()[rows].to(device),
                                     self.true_vocab)
        losses, weights = self.target.losses(probe, rows)
        self.weights[rows] = weights.reshape(rows.shape[0], 1).float().cpu()
        self.covered[rows] = True
        self._pending = losses.reshape(-1).sum() + 0.0 * kept.sum()  # a graph even where no row has a probe position
        detached = logits.detach()
        return (detached, *out[1:]) if isinstance(out, tuple) else detached

    def loss(self, **kw):
        """verl's loss call (``model_output=``, ``data=``, ``dp_group=``) on the last stage: the pending loss."""
        loss, self._pending = self._pending, None
        if loss is None:
            raise RuntimeError("oar: verl's loss call came before the output layer of its micro-batch ran")
        return loss, {}

    # ---- one engine call -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def pass_(self) -> Iterator[None]:
        """For the duration, the engine's ``infer_batch`` is this forward-backward (its other calls unchanged)."""
        from verl.utils.megatron_utils import unwrap_model
        from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

        engine = self.engine
        gpt = unwrap_model(engine.module[0])
        original_step = engine.forward_step

        def forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
            micro_batch = next(batch_iter)
            self.target  # built at the first micro-batch on every rank (weights loaded)
            self._micro_batch = self._codes(micro_batch)
            self.choices.append((int((self._micro_batch[1] > 0).sum()), float(self.recomputes)))
            return original_step(iter([micro_batch]), model, logits_processor_func, postprocess_micro_batch_func)

        def infer_batch(data, loss_function=None):
            if loss_function is not None:
                raise RuntimeError("oar: the shared Megatron pass serves compute_log_prob (no loss function)")
            maybe_fix_3d_position_ids(data)
            rule = self.target.rules  # conservative: its propagation rules, hooks that keep every forward value
            ruled = megatron_rules(engine.module, rule) if rule else contextlib.nullcontext()
            # inside verl's eval_mode: the recompute flags set after its module.eval()
            with torch.enable_grad(), no_param_grads(engine), full_recompute(engine), ruled:
                return engine.forward_backward_batch(data, self.loss, forward_only=False)

        emb = embedding_module(engine)
        head = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
        handles = []
        try:
            if emb is not None:
                handles.append(emb.register_forward_hook(self._at_embedding, with_kwargs=True))
            if head is not None:
                handles.append(head.register_forward_hook(self._at_output))
            # whatever the instance held before (verl's own methods, another wrapper) is restored after
            with patched_attributes(engine, forward_step=forward_step, infer_batch=infer_batch):
                yield
        finally:
            for h in handles:
                h.remove()

    def result(self) -> torch.Tensor:
        """(B, L) float32 scores at reasoning positions of the rows attributed, 0 elsewhere, on every rank of the
        data-parallel rank's model-parallel group (call it on all of them)."""
        from megatron.core import parallel_state as mpu

        projections = self.projections
        if self.sp:  # each tensor-parallel rank stored its own chunk's positions
            buf = _to_device(projections)
            dist.all_reduce(buf, group=mpu.get_tensor_model_parallel_group())
            projections = buf.cpu()
        if mpu.get_pipeline_model_parallel_world_size() > 1:  # first stage -> every stage
            buf = _to_device(projections)
            dist.broadcast(buf, src=mpu.get_pipeline_model_parallel_first_rank(),
                           group=mpu.get_pipeline_model_parallel_group())
            projections = buf.cpu()
        scores = self.target.finish(projections, self.weights)  # the weights: the last stage's
        keep = self.batch.reasoning_mask.cpu() & self.covered[:, None]
        return self.backend.share(torch.where(keep, scores, 0.0))


@contextlib.contextmanager
def megatron_log_prob(engine, cfg, batch: AttributionBatch, inputs: MethodInputs
                      ) -> Iterator[list[MegatronSharedAttribution]]:
    """verl's Megatron old-log-prob pass (the duration of the block) with ``cfg.mode`` read from it for ``batch``'s
    rows; yields a list holding the :class:`MegatronSharedAttribution` (once the call ran)."""
    entry = METHODS.get(cfg.mode)
    shared = MegatronSharedAttribution(MegatronBackend(engine, pass_limits(cfg)), batch,
                                       lambda backend: entry.shared(backend, batch, cfg, inputs))
    made: list[MegatronSharedAttribution] = []
    with shared.pass_():
        yield made
        if shared.choices:
            made.append(shared)
