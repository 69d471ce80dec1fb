"""A start-up warning for gradient attribution on models whose attention layers slide.

On Gemma 3 with rows longer than its sliding window, the methods that read gradients (registered with
``reads_gradients``: OAR-G, fisher, path) ranked the reasoning tokens about as well as a random ranking by the fidelity
metric, while OAR-P found what the answer depends on (docs/performance.md, "Which attribution on long rows");
conservative propagation ranks well above random there (``ranks_past_window``; research/docs/faithfulness.md §17) and
is not warned of. One model family measured: a warning naming the check and the alternative, not a refusal. Read
from the model directory's ``config.json`` alone (no model or transformers import).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from oar_verl.core.checks.model_config import local_model_config
from oar_verl.core.checks.registries import method_of

__all__ = ["check_model_sliding_window", "sliding_window", "sliding_window_warning"]

logger = logging.getLogger(__name__)


def sliding_window(model_config: Mapping) -> int | None:
    """The width of a model's sliding attention window from its config (``config.json`` as a dict); None when no
    layer slides.

    A window counts when ``sliding_window`` is set, ``use_sliding_window`` does not switch it off (Qwen2/Qwen3 configs
    carry a width they do not use), and, where ``layer_types`` lists the layers (Gemma 3, newer configs), at least one
    is ``sliding_attention``. A multimodal config's ``text_config`` is read.
    """
    config = model_config.get("text_config") or model_config
    width = config.get("sliding_window")
    if not width or config.get("use_sliding_window") is False:
        return None
    types = config.get("layer_types")
    if types is not None and "sliding_attention" not in types:
        return None
    return int(width)


def sliding_window_warning(cfg, model_config: Mapping, max_tokens: int | None, check: str | None = None
                           ) -> str | None:
    """The warning for this run (None: nothing to warn of): a method that reads gradients
    (:attr:`~oar_verl.core.methods.contract.Method.reads_gradients`) on a model with a sliding window and rows that may
    be longer than the window (``max_tokens``, prompt + response; None: unknown, warned). ``check``: how a user of
    this trainer measures the fidelity (default: verl's ``fidelity_every``)."""
    method = method_of(cfg)
    if not method.reads_gradients or method.ranks_past_window:
        return None
    width = sliding_window(model_config)
    if width is None or (max_tokens is not None and max_tokens <= width):
        return None
    rows = "of unknown length" if max_tokens is None else f"up to {max_tokens} tokens"
    check = check or f"{cfg.prefix}.fidelity_every=10 (oar/fidelity/gain near 1 is random)"
    return (f"{cfg.prefix}.mode={cfg.mode} on a model with sliding-window attention (window {width} tokens, rows "
            f"{rows}): gradient attribution of rows longer than the window ranked tokens about as well as random on "
            f"Gemma 3 (docs/performance.md, 'Which attribution on long rows'). Check it on your rollouts with {check}, "
            f"or use {cfg.prefix}.mode=perturbation")


def check_model_sliding_window(cfg, model_path: str | None, max_tokens: int | None, check: str | None = None
                               ) -> str | None:
    """Log :func:`sliding_window_warning` for a local model directory and return it (None: nothing to warn of, or a
    path that is not a local directory with a ``config.json``)."""
    model_config = local_model_config(model_path)
    if model_config is None:  # no local config (a hub id, a remote path) or an unreadable one: a warning only
        return None
    message = sliding_window_warning(cfg, model_config, max_tokens, check)
    if message is not None:
        logger.warning(message)
    return message
