"""Which Megatron layouts OAR attribution supports: checked at start-up (from the config) and on the built engine.

No megatron-core import: the start-up check runs in the driver, which may not have it.
"""

from __future__ import annotations

__all__ = ["MegatronLayoutError", "check_megatron_layout", "megatron_layout_error",
           "megatron_mode_error"]

def megatron_mode_error(oar, model_config=None) -> str | None:
    """Why the Megatron engine cannot run the configured method(s) on this model, or None: ``oar`` the
    ``algorithm.oar`` mapping (``mode``, and with ``mode=auto`` its ``auto_candidates`` and ``auto_default``),
    ``model_config`` the policy's ``config.json`` (None: unread, the engine's rules check the layers at the first
    attribution). A method that needs the propagation rules (``Method.propagation_rules``) is refused on a mixture of
    experts, whose layers the rules do not know (:mod:`.rules`)."""
    from oar_verl.core.backends.families import expert_count
    from oar_verl.core.checks.model_rules import rules_refusal

    experts = expert_count(model_config or {})
    if experts == 0:
        return None
    return rules_refusal(oar, "on the Megatron engine", f"a mixture of {experts} experts")


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
