"""What OAR knows of each Hugging Face model family, by ``config.model_type``: the one source for the facts that
differ between families (docs/method.md §13, the family matrix).

* **Post-head transforms.** Some families transform the LM head's output before returning it as logits: Gemma 2 / 3 /
  3n / 4, VaultGemma and nanochat soft-cap it (c · tanh(z / c), ``final_logit_softcapping``), Granite divides by
  ``logits_scaling``, HyperCLOVA X multiplies by it, Cohere multiplies by ``logit_scale``. verl's log-probs and OAR's
  own passes see the transformed logits; a shared read (:mod:`oar_verl.core.backends.shared`) keeps the head's output
  and applies :func:`post_head_transform` to it, the same operations in the same order, so both read one
  distribution. A family not listed whose config carries one of :data:`TRANSFORM_KEYS` has a transform OAR does not
  know: :func:`post_head_error` names it, and the shared read is switched off (the method's own passes, which read the
  model's returned logits, run instead).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from oar_verl.core.registry import Registry

Transform = Callable[[torch.Tensor], torch.Tensor]

# config keys of a post-head transform in transformers' causal LMs (a family not registered below with one of them
# set is refused by post_head_error)
TRANSFORM_KEYS = ("final_logit_softcapping", "logits_scaling", "logit_scale")

# model_type -> (the model's config -> its post-head transform, or None where the config switches it off)
POST_HEAD: Registry[Callable[[object], Transform | None]] = Registry("post-head logit transform", "model_type")


def text_config(config):
    """The text part of a (possibly multimodal) config: what the causal LM's forward reads."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _softcap(config) -> Transform | None:
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    if cap is None:
        return None

    def soft_capped(z: torch.Tensor) -> torch.Tensor:  # the modelling code's three operations, in its order
        return torch.tanh(z / cap) * cap

    return soft_capped


# the config keys that switch a non-linear post-head transform off (the conservative rules apply it themselves, at the
# head, by the identity rule: docs/method.md §13); a linear transform (a scale) needs no rule
NONLINEAR_POST_HEAD = {"final_logit_softcapping": None}


def _divided(key: str) -> Callable[[object], Transform | None]:
    def make(config) -> Transform | None:
        scale = getattr(text_config(config), key, None)
        return None if scale is None else (lambda z: z / scale)

    return make


def _multiplied(key: str) -> Callable[[object], Transform | None]:
    def make(config) -> Transform | None:
        scale = getattr(text_config(config), key, None)
        return None if scale is None else (lambda z: z * scale)

    return make


POST_HEAD.register("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                   "vaultgemma", "nanochat")(_softcap)
POST_HEAD.register("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")(_divided("logits_scaling"))
POST_HEAD.register("hyperclovax")(_multiplied("logits_scaling"))
POST_HEAD.register("cohere", "cohere2", "cohere2_moe")(_multiplied("logit_scale"))


# keys of a Hugging Face config that give a mixture of experts its expert count
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count(config) -> int:
    """The routed experts of a mixture of experts (0: a dense model), from a Hugging Face config object or its
    ``config.json`` mapping (its text part for a multimodal one)."""
    if config is None:
        return 0
    if not isinstance(config, dict):
        config = text_config(config)
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    return max((int(get(k) or 0) for k in EXPERT_KEYS), default=0)


def model_config(model: torch.nn.Module):
    """The Hugging Face config of ``model`` (plain, FSDP- or PEFT-wrapped: the wrappers forward the attribute), or
    None."""
    return getattr(model, "config", None)


def post_head_transform(config) -> Transform | None:
    """The transform the model applies to its LM head's output before returning logits (None: the logits are the
    head's output). ``config``: a Hugging Face config (or None)."""
    model_type = getattr(config, "model_type", None)
    if config is None or model_type not in POST_HEAD.names():
        return None
    return POST_HEAD.get(model_type)(config)


def nonlinear_post_head(config) -> dict:
    """The config keys (and the values that switch them off) of ``config``'s non-linear post-head transform, {} when it
    has none: under the conservative rules the model's own is switched off and the rules apply it at the head."""
    text = text_config(config) if config is not None else None
    return {k: v for k, v in NONLINEAR_POST_HEAD.items()
            if post_head_transform(config) is not None and getattr(text, k, None) is not None}


def post_head_error(config) -> str | None:
    """Why a shared read cannot reproduce this model's logits from its head's output (a family not in
    :data:`POST_HEAD` whose config sets one of :data:`TRANSFORM_KEYS`), or None. ``config``: a Hugging Face config
    object or its ``config.json`` mapping."""
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type")
    if model_type in POST_HEAD.names():
        return None
    keys = [k for k in TRANSFORM_KEYS if get(k) is not None]
    if not keys:
        return None
    return (f"model_type={model_type!r} sets {', '.join(keys)}: its logits are transformed after the LM head in a way "
            "OAR does not know, so attribution cannot be read from the head's output")
