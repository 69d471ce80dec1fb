"""verl's actor engines as attribution backends (:mod:`oar_verl.core.backends.base`), registered by verl's actor strategy
(``actor_rollout_ref.actor.strategy``, the key verl's own ``EngineRegistry`` selects engines by): the worker runs
every method the same way on FSDP, FSDP + Ulysses and Megatron, and start-up refuses a strategy nobody registered."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from oar_verl.core.methods.attribution import METHODS, module_backend, pass_limits
from oar_verl.core.backends.base import AttributionBackend
from oar_verl.core.backends.ulysses import SequenceShards
from oar_verl.core.config import OARConfig
from oar_verl.core.backends.memory import PassKind, fixed_recompute, memory_guard, model_shape, recompute_policy
from oar_verl.core.registry import Registry
from oar_verl.integration.shared_pass import fsdp_log_prob, fsdp_shared_error


@dataclass(frozen=True)
class EngineBackend:
    """How OAR attributes with one kind of verl actor engine.

    Attributes:
        make: (engine, cfg, tokens, *, pad_id, checkpointing, align) -> the backend, with the pass budget ``tokens``
            (the actor's own).
        device: engine -> where the attribution inputs go.
        eval_numerics: engine -> None; no dropout during attribution (inside ``engine.eval_mode()``).
        startup_error: verl's full config -> a message naming the setting this engine cannot attribute with, or None.
        recompute: (engine, cfg, tokens, *, checkpointing, shared) -> whether attribution's backwards recompute the
            layers (``algorithm.oar.recompute`` with the actor's ``checkpointing`` and update budget ``tokens``;
            ``shared``: they run inside the old-log-prob pass, whose own memory counts with theirs): a bool, or a
            share of the layers chosen per pass of so many tokens.
        shared_error: (engine, cfg, *, fused_kernels, packed, tokens) -> why the engine's old-log-prob pass cannot
            carry ``cfg``'s method (the worker then attributes right after it, in the same call), or None; ``tokens``:
            (the most a micro-batch of the pass holds, the update's), the same on every rank.
        shared_pass: (engine, cfg, prepared, recompute, packed) -> a context for verl's ``compute_log_prob`` that
            attributes ``prepared``'s rows from its forwards; it yields a list holding the shared attribution
            (``result()``, ``choices``) once a micro-batch ran.
        output_group: engine -> the process group of the ranks that run the same rows together (model parallelism:
            Ulysses' sequence-parallel group, Megatron's tensor × pipeline group), of which only the engine's output
            rank (``engine.is_mp_src_rank_with_outputs()``) receives verl's outputs (``infer_batch``'s, hence
            ``compute_log_prob``'s: the old-log-prob entropies); None: every rank receives its own. What a rank reads
            from those outputs is shared from the output rank to the group, so that every rank of it takes the same
            decisions with the same data (docs/verl.md).
        hf_modules: the engine runs the Hugging Face model's own modules, so start-up checks that the conservative
            rules cover them (:func:`~oar_verl.core.checks.model_rules.model_rules_error`); False: the engine builds
            its own layers, which its own rules judge (Megatron's).
    """

    make: Callable[..., AttributionBackend]
    device: Callable[[object], torch.device]
    eval_numerics: Callable[[object], None]
    startup_error: Callable[[object], str | None] = lambda config: None
    recompute: Callable[..., bool | Callable[[int], float]] = (
        lambda engine, cfg, tokens, *, checkpointing, shared=False: fixed_recompute(cfg.recompute, checkpointing))
    shared_error: Callable[..., str | None] = (
        lambda engine, cfg, *, fused_kernels, packed, tokens: "the engine's pass carries no attribution")
    shared_pass: Callable[..., contextlib.AbstractContextManager] | None = None
    output_group: Callable[[object], object | None] = lambda engine: None
    hf_modules: bool = True


ENGINE_BACKENDS: Registry[EngineBackend] = Registry("actor strategy OAR can attribute with",
                                                    "actor_rollout_ref.actor.strategy")


def _module_device(engine) -> torch.device:
    """The FSDP module's device (FSDP2 DTensor parameters: their local shard's)."""
    for p in engine.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        return local.device
    return torch.device("cpu")


def _fsdp_recompute(engine, cfg: OARConfig, tokens: int, *, checkpointing: bool, shared: bool = False
                    ) -> bool | Callable[[int], float]:
    """Per pass from the memory model, bounded by the update's peak at ``tokens`` per micro-batch plus this rank's
    parameter gradients (freed while attribution runs) and the free memory, the old-log-prob pass's own logits counted
    where attribution runs inside it (``shared``) (:func:`~oar_verl.core.backends.memory.recompute_policy`); under
    Ulysses one setting (:func:`~oar_verl.core.backends.memory.fixed_recompute`)."""
    if sequence_shards(engine) is not None:
        return fixed_recompute(cfg.recompute, checkpointing)
    grads = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in engine.module.parameters() if p.requires_grad)
    return recompute_policy(cfg.recompute, model_shape(engine.module), METHODS.get(cfg.mode).backward_pass,
                            _module_device(engine), tokens,
                            train_checkpointing=checkpointing, grad_bytes=grads,
                            host=PassKind.LOG_PROB if shared else None)


def _fsdp_backend(engine, cfg: OARConfig, tokens: int, *, pad_id: int, checkpointing: bool | Callable[[int], float],
                  align: Callable[[int], int]) -> AttributionBackend:
    """The engine's module, whole sequences per pass, with the memory guard of this accelerator; under Ulysses
    sequence parallelism, every pass sharded over the group like verl's own forward (docs/verl.md). ``checkpointing``
    a choice per pass: the guard counts a pass as recomputed unless ``recompute=never``."""
    shape = model_shape(engine.module)
    guarded = checkpointing if isinstance(checkpointing, bool) else cfg.recompute != "never"
    guard = memory_guard(_module_device(engine), shape, checkpointing=guarded) if shape is not None else None
    return module_backend(engine.module, cfg, limits=pass_limits(cfg, tokens, guard), checkpointing=checkpointing,
                          align=align, shards=sequence_shards(engine), pad_id=pad_id)


def sequence_shards(engine) -> SequenceShards | None:
    """The engine's Ulysses sequence-parallel group as :class:`SequenceShards`, None without sequence parallelism."""
    size = getattr(engine, "ulysses_sequence_parallel_size", 1) or 1
    if size <= 1:
        return None
    return SequenceShards(engine.ulysses_parallel_group, engine.ulysses_device_mesh["sp"].get_local_rank(), size)


def _fsdp_output_group(engine):
    """The Ulysses sequence-parallel group (verl's FSDP engine returns outputs on its local rank 0 only), or None."""
    shards = sequence_shards(engine)
    return None if shards is None else shards.group


def _fsdp_shared_error(engine, cfg: OARConfig, *, fused_kernels: bool, packed: bool, tokens: tuple[int, int]
                       ) -> str | None:
    """(``tokens`` unused: ``recompute=auto`` sizes each micro-batch's backward under the update's peak.)"""
    return fsdp_shared_error(sequence_shards(engine), fused_kernels=fused_kernels, packed=packed, model=engine.module)


def _fsdp_shared_pass(engine, cfg: OARConfig, prepared, recompute, packed: bool):
    return fsdp_log_prob(engine, cfg, prepared, recompute, packed, sequence_shards(engine))


ENGINE_BACKENDS.register("fsdp", "fsdp2")(EngineBackend(make=_fsdp_backend, device=_module_device,
                                                       eval_numerics=lambda engine: engine.module.eval(),
                                                       recompute=_fsdp_recompute, shared_error=_fsdp_shared_error,
                                                       shared_pass=_fsdp_shared_pass,
                                                       output_group=_fsdp_output_group))


def _megatron_backend(engine, cfg: OARConfig, tokens: int, *, pad_id: int, checkpointing: bool,
                      align: Callable[[int], int]) -> AttributionBackend:
    """The engine's own forward/backward over TP/PP/SP; it aligns data-parallel ranks itself (megatron-core is
    imported only here, so FSDP installs need none)."""
    from oar_verl.integration.megatron.backend import MegatronBackend

    return MegatronBackend(engine, pass_limits(cfg, tokens))


def _megatron_startup_error(config) -> str | None:
    from oar_verl.core.checks.model_config import local_model_config
    from oar_verl.integration.megatron.layout_checks import megatron_layout_error, megatron_mode_error

    recompute = config.get("algorithm", {}).get("oar", {}).get("recompute", "auto")
    if recompute != "auto":  # its engine runs attribution's backwards with the actor's own recompute settings
        return (f"algorithm.oar.recompute={recompute}: the Megatron engine recomputes as its own settings say "
                "(actor_rollout_ref.actor.megatron.override_transformer_config.recompute_*); keep auto")

    mode_error = megatron_mode_error(config.get("algorithm", {}).get("oar", {}),
                                     local_model_config(config.actor_rollout_ref.model.get("path", None)))
    if mode_error:
        return mode_error
    model = config.actor_rollout_ref.model
    return megatron_layout_error(config.actor_rollout_ref.actor.get("megatron", {}),
                                 mtp_enabled=bool(model.get("mtp", {}).get("enable", False)),
                                 use_fused_kernels=bool(model.get("use_fused_kernels", False)))


def _megatron_shared_error(engine, cfg: OARConfig, *, fused_kernels: bool, packed: bool, tokens: tuple[int, int]
                           ) -> str | None:
    from oar_verl.integration.megatron.shared import megatron_shared_error

    recomputes = getattr(getattr(engine, "tf_config", None), "recompute_granularity", None) == "full"
    return megatron_shared_error(cfg, fused_kernels=fused_kernels, recomputes=recomputes, tokens=tokens)


def _megatron_shared_pass(engine, cfg: OARConfig, prepared, recompute, packed: bool):
    from oar_verl.core.methods.contract import MethodInputs
    from oar_verl.integration.megatron.shared import megatron_log_prob

    return megatron_log_prob(engine, cfg, prepared.batch, MethodInputs(prepared.mask_token_id, prepared.seeds))


def _megatron_output_group(engine):
    """megatron-core's model-parallel group (tensor × pipeline: context parallelism is refused at start-up), whose
    output rank is tensor-parallel rank 0 of the last pipeline stage; None when it is this rank alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    group = mpu.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


# Megatron's engine moves micro-batches itself (inputs stay on CPU) and its eval_mode() is complete
ENGINE_BACKENDS.register("megatron")(EngineBackend(make=_megatron_backend, device=lambda engine: torch.device("cpu"),
                                                   eval_numerics=lambda engine: None,
                                                   startup_error=_megatron_startup_error,
                                                   shared_error=_megatron_shared_error,
                                                   shared_pass=_megatron_shared_pass,
                                                   output_group=_megatron_output_group, hf_modules=False))
