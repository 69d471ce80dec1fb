"""verl's start-up checks, in the driver before Ray starts: the checks every integration runs
(:func:`oar_verl.core.checks.startup.startup_checks`: the ``algorithm.oar.*`` values, the mask token, the sliding
window), then the verl settings OAR cannot run with. A bad value fails in seconds, naming the key and the allowed
values, instead of after a full rollout.
"""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from oar_verl.core.checks.mask_token import check_model_mask_token
from oar_verl.core.checks.startup import check_config, concrete_configs, startup_checks
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.integration.backends import ENGINE_BACKENDS
from oar_verl.integration.estimator import OARSetupError, read_oar_config


def validate_oar_setup(config: DictConfig) -> OARConfig:
    """Check a full verl config for OAR; returns the validated OARConfig.

    Raises:
        OARConfigError: an invalid ``algorithm.oar.*`` value (the message names the key and the allowed values), or,
            with an operator that inserts a token (``mask=pad`` / ``mask=token``), a mask token that is an EOS, an
            end-of-turn marker or another special token of the model's tokenizer
            (:func:`oar_verl.core.checks.startup.startup_checks`, the checks OpenRLHF's entry point runs too).
        OARSetupError: a verl setting OAR cannot run with: an actor strategy other than FSDP/FSDP2/Megatron, fused
            kernels (no logits), a Megatron layout the attribution does not support, or rollout-correction bypass mode on the legacy trainer
            (whose bypass path skips the pass OAR attributes in).

    Logs a warning for a gradient method on a sliding-window model past its window.
    """
    cfg = read_oar_config(config.algorithm)
    model = config.actor_rollout_ref.get("model", None) or {}
    actor = config.actor_rollout_ref.actor
    check_config(cfg)  # a bad key's name first, then the engine, then the checks that read the model
    try:
        engine = ENGINE_BACKENDS.get(actor.get("strategy", "fsdp"))
    except ValueError as e:
        raise OARSetupError(str(e)) from None
    startup_checks(cfg, model_path=model.get("path", None), tokenizer_path=model.get("tokenizer_path", None),
                   trust_remote_code=bool(model.get("trust_remote_code", False)), max_tokens=row_tokens(config),
                   hf_modules=engine.hf_modules)
    if bool(model.get("use_fused_kernels", False)):  # every engine: verl's fused forward hands back no logits
        raise OARSetupError("actor_rollout_ref.model.use_fused_kernels=True: verl's fused forward returns log-probs "
                            "without logits, and every OAR mode reads its outcome probe from the logits; set it to "
                            "False (use_liger=True keeps Liger's norm and MLP kernels)")
    msg = engine.startup_error(config)
    if msg is not None:
        raise OARSetupError(msg)
    if actor.get("strategy", "fsdp") in ("fsdp", "fsdp2") and (msg := trl_breaks_verl()) is not None:
        raise OARSetupError(msg)
    if cfg.base_estimator in ("gae",):
        raise OARConfigError(f"{cfg.prefix}.base_estimator='gae' needs a critic; OAR reshapes outcome advantages "
                             "(grpo, rloo, reinforce_plus_plus, ...)")
    rollout_corr = config.algorithm.get("rollout_correction", None)
    bypass = rollout_corr is not None and rollout_corr.get("bypass_mode", False)
    if bypass and not config.trainer.get("use_v1", True):
        raise OARSetupError("algorithm.rollout_correction.bypass_mode=true with trainer.use_v1=false: the legacy "
                            "trainer's bypass path skips the old-log-prob step that OAR attributes in; use the V1 "
                            "trainer (trainer.use_v1=true), which supports bypass mode, or set bypass_mode=false")
    return cfg


def trl_breaks_verl() -> str | None:
    """Why the installed TRL would stop verl's FSDP actor, or None. verl 0.9.1's FSDP engine patches TRL's value-head
    model whenever TRL is importable (``verl.models.transformers.monkey_patch``); TRL releases that dropped PPO have no
    such class, and every actor then fails in its Ray worker after the driver has started. Checked in the driver."""
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        if importlib.util.find_spec("trl.experimental.ppo") is not None:
            return None
    except ImportError:
        pass
    import trl

    if hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        return None
    version = getattr(trl, "__version__", "?")
    return (f"trl {version} is installed in verl's environment: verl 0.9.1's FSDP engine imports TRL's "
            "AutoModelForCausalLMWithValueHead whenever TRL is importable, and this TRL no longer has it, so every "
            "actor would fail in its Ray worker; uninstall trl from this environment (pip uninstall trl) and run "
            "OAR's TRL adapter from its own environment (docs/trl.md)")


def row_tokens(config: DictConfig) -> int | None:
    """The longest row the run can attribute, ``data.max_prompt_length`` + ``data.max_response_length``; None when
    either is missing."""
    data = config.get("data", None) or {}
    lengths = [data.get(k, None) for k in ("max_prompt_length", "max_response_length")]
    return sum(int(n) for n in lengths) if all(n is not None for n in lengths) else None


def validate_mask_token(cfg: OARConfig, config: DictConfig, tokenizer=None) -> int | None:
    """Refuse an unsafe OAR-P / fisher mask token once the trainer has its tokenizer (a remote model path is not read
    at start-up): the start-up's mask-token check (:func:`oar_verl.core.checks.mask_token.check_model_mask_token`)
    with the trainer's ``tokenizer`` (None: loaded from a local ``actor_rollout_ref.model`` path)."""
    model = config.actor_rollout_ref.get("model", None) or {}
    ids = [check_model_mask_token(c, model.get("path", None), tokenizer, tokenizer_path=model.get("tokenizer_path", None),
                                  trust_remote_code=bool(model.get("trust_remote_code", False)))
           for c in concrete_configs(cfg)]  # mode=auto: every mode it may attribute with
    return next((i for i in ids if i is not None), None)
