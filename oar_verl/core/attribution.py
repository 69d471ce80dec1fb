"""One entry point for token attribution: picks the probe for the step, runs OAR-P or OAR-G.

The verl worker calls :func:`run_attribution` on its own module (after :func:`oar_verl.core.preprocess.
prepare_attribution`); tests and benchmarks call the same functions on a plain Hugging Face model.
"""

from __future__ import annotations

import torch

from collections.abc import Callable
from dataclasses import dataclass

from oar_verl.core import gradient, perturbation
from oar_verl.core.budget import Fits, PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.hierarchical import policy_importance
from oar_verl.core.layout import AttributionBatch, build_attribution_batch, with_segments
from oar_verl.core.probes import ProbeKind
from oar_verl.core.sequence_parallel import (SequenceShards, collective_rounds_sharded, oar_g_importance_sharded,
                                             oar_p_importance_sharded)

# the budget when neither the configuration nor the trainer gives one (core-only use): a typical verl
# ppo_max_token_len_per_gpu
DEFAULT_MAX_TOKENS = 16384


@dataclass(frozen=True)
class AttributionResult:
    """What :func:`run_attribution` computed.

    Attributes:
        importance: (B, L) float32, 0 off the reasoning tokens.
        rounds: the passes this rank ran for itself (before alignment with the other ranks).
        copies: (B,) long OAR-P masked copies per row (None for OAR-G).
        refined: (B,) long reasoning tokens per row with a token-level OAR-P score (None for OAR-G).
        reasoning: (B,) long reasoning tokens per row (None for OAR-G).
    """

    importance: torch.Tensor
    rounds: int
    copies: torch.Tensor | None = None
    refined: torch.Tensor | None = None
    reasoning: torch.Tensor | None = None


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
    """Collective rounds the configured method runs on ``batch``; data-parallel ranks align on the max (OAR-P's
    segment-level policies align level by level inside :func:`run_attribution` instead: give it ``align``)."""
    if cfg.mode == "perturbation":
        return perturbation.collective_rounds(batch, limits, cfg.prefix_cache, cfg.mask_span)
    return gradient.collective_rounds(batch, limits, cfg.noise_samples)


def run_attribution(model: torch.nn.Module, batch: AttributionBatch, cfg: OARConfig, *, mask_token_id: int | None,
                    seeds: torch.Tensor | None = None, limits: PassLimits | None = None, min_rounds: int = 0,
                    checkpointing: bool = False, align: Callable[[int], int] | None = None,
                    shards: SequenceShards | None = None, pad_id: int = 0) -> AttributionResult:
    """Importance of the batch's reasoning tokens with the configured method.

    Args:
        model: causal LM in eval mode.
        batch: AttributionBatch (B, L) (with ``segments`` for OAR-P's segment-level policies).
        cfg: OARConfig.
        mask_token_id: OAR-P mask token (required for perturbation).
        seeds: (B,) int64 OAR-G noise seeds (required for gradient).
        limits: the token budget of one pass (default: :func:`pass_limits` of ``cfg``).
        min_rounds: collective rounds to run at least (the max of :func:`collective_rounds` over ranks); ignored
            when ``align`` is given.
        checkpointing: OAR-G checkpoints the decoder layers (the actor's gradient-checkpointing setting).
        align: maps this rank's collective rounds of a pass sequence to the rounds every data-parallel rank runs
            (the max over ranks); called once per level, on every rank alike.
        shards: a Ulysses sequence-parallel group: every pass is sharded over it
            (:mod:`oar_verl.core.sequence_parallel`); None: whole sequences.
        pad_id: the token filling the last shard (with ``shards``).

    Returns:
        AttributionResult: (B, L) float32 importance (0 off the reasoning tokens) and what ran.
    """
    limits = limits or pass_limits(cfg)
    if align is None:
        if min_rounds and cfg.mode == "perturbation" and cfg.perturbation != "exact":
            raise ValueError(f"{cfg.prefix}.perturbation={cfg.perturbation!r} aligns ranks level by level: pass "
                             "align, not min_rounds")
        align = lambda n: max(n, min_rounds)  # noqa: E731 - the one rank's own rounds, at least min_rounds
    if cfg.mode == "gradient":
        if seeds is None:
            raise ValueError("OAR-G needs per-sequence noise seeds (see oar_verl.core.gradient.sequence_seeds)")
        K = cfg.noise_samples
        if shards is not None:
            own = collective_rounds_sharded(batch, "gradient", limits, shards, samples=K)
            return AttributionResult(oar_g_importance_sharded(model, batch, cfg.noise_std, seeds, limits, shards,
                                                              pad_id, align(own), checkpointing, samples=K), own)
        own = gradient.collective_rounds(batch, limits, K)
        return AttributionResult(gradient.oar_g_importance(model, batch, cfg.noise_std, seeds, limits, align(own),
                                                           checkpointing, samples=K), own)
    if mask_token_id is None:
        raise ValueError("OAR-P needs a mask token: set algorithm.oar.mask_token_id or give the tokenizer a pad token")
    own = 0

    def run_blocks(blocks: torch.Tensor) -> torch.Tensor:  # one level of the policy, aligned over the ranks
        nonlocal own
        if shards is not None:
            n = collective_rounds_sharded(batch, "perturbation", limits, shards, blocks=blocks)
            own += n
            return oar_p_importance_sharded(model, batch, mask_token_id, limits, shards, pad_id, align(n),
                                            blocks=blocks)
        n = perturbation.collective_rounds(batch, limits, cfg.prefix_cache, blocks=blocks)
        own += n
        return perturbation.oar_p_importance(model, batch, mask_token_id, limits, align(n),
                                             prefix_cache=cfg.prefix_cache, blocks=blocks)

    res = policy_importance(run_blocks, batch.reasoning_mask, batch.segments, cfg.perturbation,
                            refine_share=cfg.refine_share, exact_max_tokens=cfg.exact_max_tokens,
                            exact_blocks=perturbation.mask_blocks(batch.reasoning_mask, cfg.mask_span))
    return AttributionResult(res.importance, own, res.copies, res.refined, res.reasoning)


def response_importance(model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                        responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                        answer_mask: torch.Tensor, cfg: OARConfig, *, global_step: int = 0,
                        mask_token_id: int | None = None, seeds: torch.Tensor | None = None,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
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
        segments: (B, T) long reasoning-segment ids (:func:`oar_verl.core.segments.reasoning_segments`), needed by
            OAR-P's segment-level policies.
    """
    kinds = probe_kinds(cfg, global_step, prompts.shape[0], prompts.device)
    batch = build_attribution_batch(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                    kinds)
    if segments is not None:
        batch = with_segments(batch, segments)
    return run_attribution(model, batch, cfg, mask_token_id=mask_token_id,
                           seeds=seeds).importance[:, batch.response_start:]
