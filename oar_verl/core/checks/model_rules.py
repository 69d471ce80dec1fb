"""The conservative rules against the policy's model, at start-up (docs/method.md §13, the family matrix).

A method with ``propagation_rules`` (the default, ``conservative``) is refused before anything runs on a model whose
non-linearities the rules do not all cover (:func:`~oar_verl.core.backends.rules.rules_error`: a mixture of experts,
LayerNorm, an ungated MLP, a fused q/k/v projection, a module the rules do not know), naming the model type, the key
and the modes that work there. The model is built from its ``config.json`` on the meta device (no weights, no memory).
A model whose config cannot be read here (a hub id, a remote path) is checked by the rules themselves at the first
attribution.
"""

from __future__ import annotations

import logging

from oar_verl.core.checks.registries import METHODS
from oar_verl.core.config import AUTO_MODE, OARConfig

logger = logging.getLogger("oar_verl")

__all__ = ["model_rules_error", "rules_refusal"]


def rules_refusal(oar, where: str, reason: str) -> str | None:
    """The start-up message refusing the configured mode(s) that need the conservative rules (``Method.
    propagation_rules``) on a model they do not cover, or None when none does. ``oar``: an OARConfig or the
    ``algorithm.oar`` mapping (with ``mode=auto``, its ``auto_candidates`` and ``auto_default`` count);
    ``where``: the engine or model type ("on the Megatron engine"); ``reason``: why the rules do not cover it."""
    cfg = oar if isinstance(oar, OARConfig) else OARConfig.from_mapping(oar)  # the keys' defaults where unset
    auto = cfg.mode == AUTO_MODE
    modes = [cfg.mode] + ([*cfg.auto_candidates, cfg.auto_default] if auto else [])
    needs = [m for m in modes if m in METHODS.names() and METHODS.get(m).propagation_rules]
    if not needs:
        return None
    others = [n for n in METHODS.names() if not METHODS.get(n).propagation_rules]
    p = cfg.prefix
    if auto:
        place, fix = f" (in {p}.auto_candidates / auto_default)", (
            f"list only {', '.join(others)} (e.g. {p}.auto_candidates=[fisher,gradient] {p}.auto_default=fisher)")
    else:
        default = needs[0] == OARConfig.__dataclass_fields__["mode"].default
        place, fix = " (the key's default)" if default else "", (
            f"set {p}.mode to one of {', '.join(others)} (fisher: the same clean input-gradient pass without the "
            "rules)")
    return f"{p}.mode={needs[0]}{place} {where}: the conservative propagation rules do not cover it ({reason}); {fix}"


def model_rules_error(cfg: OARConfig, model_path: str | None, trust_remote_code: bool = False) -> str | None:
    """Why the configured mode(s) cannot run their rules on the Hugging Face model at ``model_path`` (a local
    directory), or None (no mode needs the rules, the rules cover the model, or its config is not readable here)."""
    if rules_refusal(cfg, "", "") is None or not model_path:
        return None
    model = meta_model(model_path, trust_remote_code)
    if model is None:
        return None
    from oar_verl.core.backends.rules import rules_error

    reason = rules_error(model, cfg.attention_rule)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    return None if reason is None else rules_refusal(cfg, f"on model_type={model_type}", reason)


def meta_model(model_path: str, trust_remote_code: bool = False):
    """The causal LM of a local model directory built on the meta device from its config (no weights), or None when
    its config cannot be read or built here (logged: the rules then check the model at the first attribution)."""
    import os

    if not os.path.isfile(os.path.join(str(model_path), "config.json")):
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # an architecture this transformers cannot build as a causal LM: checked at the first step
        logger.warning("oar: the model at %s could not be built from its config at start-up (%s: %s); the conservative "
                       "rules check it at the first attribution", model_path, type(e).__name__, e)
        return None
