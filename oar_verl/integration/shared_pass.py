"""verl's old-log-prob pass with attribution read from it (``algorithm.oar.shared_forward``; docs/method.md §14).

verl's FSDP engine runs the old-log-prob pass micro-batch by micro-batch through ``engine.forward_step`` (rows packed
end to end with remove-padding, else right-padded to the micro-batch's longest; under Ulysses each rank's forward holds
one shard of the packed rows, which the shared attribution reads as such). For the duration of one
``compute_log_prob`` call the worker runs each micro-batch's forward inside
:meth:`~oar_verl.core.backends.shared.SharedAttribution.forward`, with the :class:`~oar_verl.core.backends.shared.
ForwardLayout` of its rows (each micro-batch carries its rows' indices in :data:`~oar_verl.integration.fields.
ROW_FIELD`): through verl's per-micro-batch contexts where the engine has them (patches/0005), else by a wrapper in
front of ``forward_step`` on the engine instance. verl computes its log-probs from the same logits as without it.
For OAR-G the forward runs inside a :class:`~oar_verl.core.backends.shared.SharedTeacher` instead (its clean teachers
only; the worker runs its noisy passes after the pass).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from oar_verl.core.backends.budget import row_spans
from oar_verl.core.backends.families import model_config, post_head_error
from oar_verl.core.backends.patching import patched_attributes
from oar_verl.core.backends.shared import ForwardLayout, SharedAttribution, SharedTeacher
from oar_verl.core.methods.attribution import shared_attribution
from oar_verl.core.preprocess import PreparedAttribution
from oar_verl.core.backends.ulysses import SequenceShards
from oar_verl.integration.fields import ROW_FIELD

# what a forward is read by: the method's scores, or OAR-G's clean teachers
SharedReader = SharedAttribution | SharedTeacher


def fsdp_shared_error(shards: SequenceShards | None, *, fused_kernels: bool, packed: bool = True,
                      model: torch.nn.Module | None = None) -> str | None:
    """Why verl's FSDP old-log-prob pass cannot carry attribution (the worker then attributes after it, in the same
    call), or None. Under Ulysses (``shards``: the engine's group) the pass is sharded like verl's (remove-padding,
    which verl requires there); ``model``'s logits must be its head's output or a transform OAR knows
    (:func:`~oar_verl.core.backends.families.post_head_error`)."""
    unknown = post_head_error(model_config(model)) if model is not None else None
    if unknown is not None:
        return unknown
    if shards is not None and not packed:
        return "Ulysses sequence parallelism without use_remove_padding"
    if fused_kernels:
        return "use_fused_kernels=true (the fused head computes no logits)"
    return None


def fsdp_log_prob(engine, cfg, prepared: PreparedAttribution, recompute, packed: bool,
                  shards: SequenceShards | None) -> contextlib.AbstractContextManager[list[SharedReader]]:
    """verl's FSDP old-log-prob pass (the duration of the block) with ``cfg.mode`` read from every micro-batch of
    ``prepared``'s rows (``recompute``: the share of layers each pass recomputes; ``packed``: verl's remove-padding
    layout; ``shards``: the engine's Ulysses group): :func:`attributed_log_prob` with the core's
    :func:`~oar_verl.core.methods.attribution.shared_attribution` on the engine's module."""
    batch = prepared.batch

    def make():
        engine.module.eval()  # no dropout (inside verl's eval_mode, weights loaded)
        return shared_attribution(engine.module, batch, cfg, recompute, mask_token_id=prepared.mask_token_id,
                                  seeds=prepared.seeds, shards=shards)

    return attributed_log_prob(engine, make, row_spans(batch.attention_mask), batch.input_ids, packed)


@contextlib.contextmanager
def attributed_log_prob(engine, make: Callable[[], SharedReader], spans: tuple[torch.Tensor, torch.Tensor],
                        input_ids: torch.Tensor, packed: bool) -> Iterator[list[SharedReader]]:
    """For the duration, every micro-batch of ``engine``'s forwards is attributed as it runs: through verl's
    per-micro-batch contexts where the engine has them (patches/0005), else around ``forward_step`` wrapped on the
    instance (restored on the way out).

    Args:
        engine: verl's FSDP engine.
        make: builds the shared attribution at the first micro-batch (inside verl's ``eval_mode``, weights loaded).
        spans: (B,) long first and one-past-last batch column of every row (the prepared batch's
            :func:`~oar_verl.core.backends.budget.row_spans`).
        input_ids: (B, L) long the prepared batch's ids: each micro-batch's rows must be these rows, whole.
        packed: verl's remove-padding layout (a micro-batch's rows end to end); else right-padded to its longest.

    Yields:
        a list that holds the reader (:data:`SharedReader`) once a micro-batch ran.
    """
    made: list[SharedReader] = []

    def attributed(micro_batch, forward_only=True) -> contextlib.AbstractContextManager:
        if not made:
            made.append(make())
        starts, ends = spans
        device = starts.device
        rows = micro_batch[ROW_FIELD].to(device).long()
        ids = micro_batch["input_ids"]
        lengths = ids.offsets().diff().to(device).long()
        width = None if packed else int(lengths.max())  # verl pads each micro-batch to its longest row
        layout = ForwardLayout.sequences(rows, lengths, starts[rows], width)
        # the micro-batch's rows are the attributed rows, whole and token for token: one check per micro-batch
        if not bool((lengths == ends[rows] - starts[rows]).all()
                    and (ids.values().to(device) == input_ids[layout.row, layout.col]).all()):
            raise RuntimeError("oar: a micro-batch of the old-log-prob pass does not hold the rows being attributed "
                               "whole (its rows' lengths or tokens differ from the prompts and responses of the "
                               "batch)")
        return made[0].forward(layout)

    register = getattr(engine, "register_micro_batch_context", None)
    if register is not None:  # verl with patches/0005
        remove = register(attributed)
        try:
            yield made
        finally:
            remove()
        return
    original = engine.forward_step

    def forward_step(micro_batch, loss_function, forward_only):
        with attributed(micro_batch):
            return original(micro_batch, loss_function, forward_only)

    with patched_attributes(engine, forward_step=forward_step):  # whatever was on the instance, restored after
        yield made
