"""One entry point for token attribution: picks the probe for the step, runs OAR-P or OAR-G.

The verl worker calls :func:`run_attribution` on its own module (after :func:`oar_verl.core.preprocess.
prepare_attribution`); tests and benchmarks call the same functions on a plain Hugging Face model.
"""

from __future__ import annotations

import torch

from oar_verl.core import gradient, perturbation
from oar_verl.core.budget import Fits, PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.layout import AttributionBatch, build_attribution_batch
from oar_verl.core.probes import ProbeKind

# the budget when neither the configuration nor the trainer gives one (core-only use): a typical verl
# ppo_max_token_len_per_gpu
DEFAULT_MAX_TOKENS = 16384


def probe_kinds(cfg: OARConfig, global_step: int, batch_size: int, device=None) -> torch.Tensor:
    """(B,) :class:`ProbeKind` of every row at this step (rows without an answer span fall back to LT-Logits later)."""
    kind = ProbeKind.from_name(cfg.probe_for_step(global_step))
    return torch.full((batch_size,), int(kind), dtype=torch.long, device=device)


def pass_limits(cfg: OARConfig, default_tokens: int | None = None, fits: Fits | None = None) -> PassLimits:
    """The limits of one attribution pass: ``algorithm.oar.max_token_len_per_gpu`` if set, else ``default_tokens``
    (the actor's own budget, from the trainer), else :data:`DEFAULT_MAX_TOKENS`; the optional row and copy caps; the
    memory guard."""
    tokens = cfg.max_token_len_per_gpu or default_tokens or DEFAULT_MAX_TOKENS
    return PassLimits(int(tokens), rows=cfg.micro_batch_size, copies=cfg.chunk_size, fits=fits,
                      key=f"{cfg.prefix}.max_token_len_per_gpu")


def collective_rounds(batch: AttributionBatch, cfg: OARConfig, limits: PassLimits) -> int:
    """Collective rounds the configured method runs on ``batch``; data-parallel ranks align on the max."""
    if cfg.mode == "perturbation":
        return perturbation.collective_rounds(batch, limits, cfg.prefix_cache, cfg.mask_span)
    return gradient.collective_rounds(batch, limits)


def run_attribution(model: torch.nn.Module, batch: AttributionBatch, cfg: OARConfig, *, mask_token_id: int | None,
                    seeds: torch.Tensor | None = None, limits: PassLimits | None = None, min_rounds: int = 0,
                    checkpointing: bool = False) -> torch.Tensor:
    """Importance of the batch's reasoning tokens with the configured method.

    Args:
        model: causal LM in eval mode.
        batch: AttributionBatch (B, L).
        cfg: OARConfig.
        mask_token_id: OAR-P mask token (required for perturbation).
        seeds: (B,) int64 OAR-G noise seeds (required for gradient).
        limits: the token budget of one pass (default: :func:`pass_limits` of ``cfg``).
        min_rounds: collective rounds to run at least (the max of :func:`collective_rounds` over ranks).
        checkpointing: OAR-G checkpoints the decoder layers (the actor's gradient-checkpointing setting).

    Returns:
        (B, L) float32 importance, 0 off the reasoning tokens.
    """
    limits = limits or pass_limits(cfg)
    if cfg.mode == "perturbation":
        if mask_token_id is None:
            raise ValueError("OAR-P needs a mask token: set algorithm.oar.mask_token_id or give the tokenizer a pad "
                             "token")
        return perturbation.oar_p_importance(model, batch, mask_token_id, limits, min_rounds,
                                             prefix_cache=cfg.prefix_cache, mask_span=cfg.mask_span)
    if seeds is None:
        raise ValueError("OAR-G needs per-sequence noise seeds (see oar_verl.core.gradient.sequence_seeds)")
    return gradient.oar_g_importance(model, batch, cfg.noise_std, seeds, limits, min_rounds, checkpointing)


def response_importance(model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                        responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                        answer_mask: torch.Tensor, cfg: OARConfig, *, global_step: int = 0,
                        mask_token_id: int | None = None, seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Convenience wrapper over verl's padded layout: (B, T) response-aligned importance.

    Args:
        prompts: (B, P) left-padded.
        prompt_mask: (B, P).
        responses: (B, T) right-padded.
        response_mask: (B, T).
        reasoning_mask: (B, T) bool (from :func:`oar_verl.core.spans.locate_answer_spans`).
        answer_mask: (B, T) bool.
        cfg: OARConfig.
        global_step: selects the probe (``probe=auto``).
        mask_token_id: OAR-P mask token.
        seeds: (B,) OAR-G noise seeds.
    """
    kinds = probe_kinds(cfg, global_step, prompts.shape[0], prompts.device)
    batch = build_attribution_batch(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                    kinds)
    return run_attribution(model, batch, cfg, mask_token_id=mask_token_id, seeds=seeds)[:, batch.response_start:]
