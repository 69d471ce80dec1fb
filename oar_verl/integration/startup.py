"""Start-up checks: everything OAR needs from the configuration, validated in the driver before Ray starts.

A bad ``algorithm.oar.*`` value or a verl setting OAR cannot run with fails in seconds, naming the key and the allowed
values, instead of after a full rollout.
"""

from __future__ import annotations

from omegaconf import DictConfig

from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.checks.mask_token import check_model_mask_token
from oar_verl.core.checks.sliding_window import check_model_sliding_window
from oar_verl.integration.backends import ENGINE_BACKENDS
from oar_verl.integration.estimator import OARSetupError, read_oar_config


def validate_oar_setup(config: DictConfig) -> OARConfig:
    """Check a full verl config for OAR; returns the validated OARConfig.

    Raises:
        OARConfigError: an invalid ``algorithm.oar.*`` value (the message names the key and the allowed range).
        OARConfigError: with ``mask=pad`` / ``mask=token``, a mask token that is an EOS, an end-of-turn marker or
            another special token of the model's tokenizer (:func:`validate_mask_token`).
        OARSetupError: a verl setting OAR cannot run with: an actor strategy other than FSDP/FSDP2/Megatron, a
            Megatron layout the attribution does not support, or rollout-correction bypass mode on the legacy trainer
            (whose bypass path skips the pass OAR attributes in).

    Logs a warning (:func:`warn_sliding_window`) for a gradient method on a sliding-window model past its window.
    """
    cfg = read_oar_config(config.algorithm)
    actor = config.actor_rollout_ref.actor
    try:
        engine = ENGINE_BACKENDS.get(actor.get("strategy", "fsdp"))
    except ValueError as e:
        raise OARSetupError(str(e)) from None
    msg = engine.startup_error(config)
    if msg is not None:
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
    validate_mask_token(cfg, config)
    warn_sliding_window(cfg, config)
    return cfg


def warn_sliding_window(cfg: OARConfig, config: DictConfig) -> str | None:
    """Warn (logged, returned) of a gradient method (``mode=gradient|fisher``) on a local model whose attention
    layers slide, with rows (``data.max_prompt_length`` + ``data.max_response_length``) longer than the window
    (:mod:`oar_verl.core.checks.sliding_window`)."""
    data = config.get("data", None) or {}
    lengths = [data.get(k, None) for k in ("max_prompt_length", "max_response_length")]
    total = sum(int(n) for n in lengths) if all(n is not None for n in lengths) else None
    model = config.actor_rollout_ref.get("model", None) or {}
    return check_model_sliding_window(cfg, model.get("path", None), total)


def validate_mask_token(cfg: OARConfig, config: DictConfig, tokenizer=None) -> int | None:
    """Refuse an unsafe OAR-P / fisher mask token (``mask=pad`` / ``mask=token``) before the first rollout: an EOS of
    the tokenizer or of the model's generation config, a token of the chat template, another special token
    (:func:`oar_verl.core.checks.mask_token.unsafe_mask_reason`). ``tokenizer``: the trainer's own; None loads it from a local
    ``actor_rollout_ref.model`` path (a remote one is checked once the trainer has its tokenizer)."""
    model = config.actor_rollout_ref.get("model", None) or {}
    return check_model_mask_token(cfg, model.get("path", None), tokenizer,
                                  tokenizer_path=model.get("tokenizer_path", None),
                                  trust_remote_code=bool(model.get("trust_remote_code", False)))
