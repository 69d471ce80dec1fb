"""verl's actor engines as attribution backends (:mod:`oar_verl.core.engine`): the one place that knows which engine
is which, so the worker runs every method the same way on FSDP, FSDP + Ulysses and Megatron."""

from __future__ import annotations

from collections.abc import Callable

import torch

from oar_verl.core.attribution import attribution_backend, pass_limits
from oar_verl.core.backend_ulysses import SequenceShards
from oar_verl.core.config import OARConfig
from oar_verl.core.engine import AttributionBackend
from oar_verl.core.memory import memory_guard, model_shape


def is_megatron(engine) -> bool:
    """Whether ``engine`` is verl's Megatron engine (FSDP installs lack megatron-core: no import)."""
    return type(engine).__module__.startswith("verl.workers.engine.megatron")


def engine_device(engine) -> torch.device:
    """Where attribution inputs live: the FSDP module's device; CPU for Megatron (the engine moves micro-batches)."""
    if is_megatron(engine):
        return torch.device("cpu")
    for p in engine.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor shards
        return local.device
    return torch.device("cpu")


def engine_backend(engine, cfg: OARConfig, tokens: int, *, mask_token_id: int | None, pad_id: int,
                   checkpointing: bool, align: Callable[[int], int]) -> AttributionBackend:
    """The backend of a verl actor engine, with the attribution pass budget ``tokens`` (the actor's own).

    FSDP: the engine's module, whole sequences per pass, with the memory guard of this accelerator; under Ulysses
    sequence parallelism, every pass sharded over the group like verl's own forward (docs/verl.md). Megatron: the
    engine's own forward/backward over TP/PP/SP (it aligns data-parallel ranks itself).
    """
    if is_megatron(engine):
        from oar_verl.integration.megatron.backend import MegatronBackend

        return MegatronBackend(engine, pass_limits(cfg, tokens), mask_token_id=mask_token_id)
    shape = model_shape(engine.module)
    device = engine_device(engine)
    guard = memory_guard(device, shape, checkpointing=checkpointing) if shape is not None else None
    return attribution_backend(engine.module, cfg, pass_limits(cfg, tokens, guard), mask_token_id=mask_token_id,
                               checkpointing=checkpointing, align=align, shards=sequence_shards(engine),
                               pad_id=pad_id)


def sequence_shards(engine) -> SequenceShards | None:
    """The engine's Ulysses sequence-parallel group as :class:`SequenceShards`, None without sequence parallelism."""
    size = getattr(engine, "ulysses_sequence_parallel_size", 1) or 1
    if size <= 1:
        return None
    return SequenceShards(engine.ulysses_parallel_group, engine.ulysses_device_mesh["sp"].get_local_rank(), size)


def eval_numerics(engine) -> None:
    """No dropout during attribution (inside ``engine.eval_mode()``, which Megatron's engine makes complete)."""
    if not is_megatron(engine):
        engine.module.eval()
