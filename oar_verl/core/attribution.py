"""One entry point for token attribution: picks the probe for the step, builds the runtime's backend, runs OAR-P or
OAR-G on the attribution engine (:mod:`oar_verl.core.engine`).

The verl worker calls :func:`run_attribution` with its engine's backend (after :func:`oar_verl.core.preprocess.
prepare_attribution`); tests, benchmarks and core-only users (TRL, plain Hugging Face) call the same function on a
plain module, which gets the same safe settings as the worker: a token budget, gradient checkpointing in OAR-G.
"""

from __future__ import annotations

import torch

from collections.abc import Callable
from dataclasses import dataclass

from oar_verl.core.backend_hf import ModuleBackend
from oar_verl.core.backend_ulysses import SequenceShards, UlyssesBackend
from oar_verl.core.budget import Fits, PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.engine import AttributionBackend
from oar_verl.core.fisher import fisher
from oar_verl.core.gradient import oar_g
from oar_verl.core.layout import AttributionBatch, build_attribution_batch, with_segments
from oar_verl.core.perturbation import mask_blocks, oar_p, oar_p_passes
from oar_verl.core.policies import policy_importance
from oar_verl.core.memory import PassKind
from oar_verl.core.probes import ProbeKind

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


def attribution_backend(model: torch.nn.Module | None, cfg: OARConfig, limits: PassLimits, *,
                        mask_token_id: int | None = None, checkpointing: bool = True,
                        align: Callable[[int], int] | None = None, shards: SequenceShards | None = None,
                        pad_id: int = 0) -> AttributionBackend:
    """The backend of a Hugging Face module: whole sequences per pass, or sharded over a Ulysses group (``shards``)."""
    if shards is not None:
        return UlyssesBackend(model, limits, shards, mask_token_id=mask_token_id, pad_id=pad_id,
                              checkpointing=checkpointing, align=align)
    return ModuleBackend(model, limits, mask_token_id=mask_token_id, prefix_cache=cfg.prefix_cache,
                         checkpointing=checkpointing, align=align)


def collective_rounds(batch: AttributionBatch, cfg: OARConfig, limits: PassLimits,
                      shards: SequenceShards | None = None) -> int:
    """Collective rounds the configured method runs on ``batch`` with a Hugging Face module; data-parallel ranks
    align on the max (OAR-P's segment-level policies align level by level inside :func:`run_attribution` instead:
    give it ``align``)."""
    backend = attribution_backend(None, cfg, limits, shards=shards)
    if cfg.mode == "perturbation":
        return len(oar_p_passes(backend, batch, mask_blocks(batch.reasoning_mask, cfg.mask_span)))
    draws = cfg.noise_samples if cfg.mode == "gradient" else cfg.fisher_outcomes
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
    return len(backend.plan(batch, rows.repeat_interleave(draws), PassKind.INPUT_GRADIENT))


def check_inputs(cfg: OARConfig, mask_token_id: int | None, seeds: torch.Tensor | None) -> None:
    """The per-method inputs are there: OAR-P's mask token, OAR-G's noise seeds."""
    if cfg.mode == "gradient" and seeds is None:
        raise ValueError("OAR-G needs per-sequence noise seeds (see oar_verl.core.gradient.sequence_seeds)")
    if cfg.mode in ("perturbation", "fisher") and mask_token_id is None:
        what = "OAR-P" if cfg.mode == "perturbation" else f"{cfg.prefix}.mode=fisher"
        raise ValueError(f"{what} needs a mask token: set {cfg.prefix}.mask_token_id or give the tokenizer a pad token")


def run_attribution(model: torch.nn.Module | AttributionBackend, batch: AttributionBatch, cfg: OARConfig, *,
                    mask_token_id: int | None = None, seeds: torch.Tensor | None = None,
                    limits: PassLimits | None = None, min_rounds: int = 0, checkpointing: bool = True,
                    align: Callable[[int], int] | None = None, shards: SequenceShards | None = None,
                    pad_id: int = 0) -> AttributionResult:
    """Importance of the batch's reasoning tokens with the configured method, on any runtime.

    Safe by default for core-only use: passes are packed under a token budget (:func:`pass_limits`: 16,384 tokens
    unless the config or the caller says otherwise) and OAR-G's student pass checkpoints the decoder layers, so
    attribution holds no more than a checkpointed training step on the same tokens. Pass ``checkpointing=False`` only
    when memory is plentiful (it saves one recomputed forward per student pass).

    Args:
        model: a Hugging Face causal LM in eval mode (plain or FSDP-wrapped; with ``shards``: sharded over a Ulysses
            group), or a ready :class:`~oar_verl.core.engine.AttributionBackend` (e.g. verl's Megatron engine's,
            ``oar_verl.integration.megatron.backend.MegatronBackend``; then ``limits``, ``checkpointing``,
            ``align``, ``shards`` and ``pad_id`` are the backend's own and ignored here).
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
        shards: a Ulysses sequence-parallel group: every pass is sharded over it; None: whole sequences.
        pad_id: the token filling the last shard (with ``shards``).

    Returns:
        AttributionResult: (B, L) float32 importance (0 off the reasoning tokens) and what ran.
    """
    check_inputs(cfg, mask_token_id, seeds)
    if isinstance(model, torch.nn.Module) or model is None:
        if align is None:
            if min_rounds and cfg.mode == "perturbation" and cfg.perturbation != "exact":
                raise ValueError(f"{cfg.prefix}.perturbation={cfg.perturbation!r} aligns ranks level by level: pass "
                                 "align, not min_rounds")
            align = lambda n: max(n, min_rounds)  # noqa: E731 - the one rank's own rounds, at least min_rounds
        backend = attribution_backend(model, cfg, limits or pass_limits(cfg), mask_token_id=mask_token_id,
                                      checkpointing=checkpointing, align=align, shards=shards, pad_id=pad_id)
    else:
        backend = model
    if cfg.mode == "gradient":
        importance, own = oar_g(backend, batch, seeds, cfg.noise_std, cfg.noise_samples)
        return AttributionResult(importance, own)
    if cfg.mode == "fisher":
        return AttributionResult(*fisher(backend, batch, cfg.fisher_outcomes))
    own = 0

    def run_blocks(blocks: torch.Tensor) -> torch.Tensor:  # one level of the policy, aligned over the ranks
        nonlocal own
        importance, n = oar_p(backend, batch, blocks)
        own += n
        return importance

    res = policy_importance(run_blocks, batch.reasoning_mask, batch.segments, cfg.perturbation,
                            refine_share=cfg.refine_share, exact_max_tokens=cfg.exact_max_tokens,
                            exact_blocks=mask_blocks(batch.reasoning_mask, cfg.mask_span))
    return AttributionResult(res.importance, own, res.copies, res.refined, res.reasoning)


def response_importance(model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                        responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                        answer_mask: torch.Tensor, cfg: OARConfig, *, global_step: int = 0,
                        mask_token_id: int | None = None, seeds: torch.Tensor | None = None,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
    """Convenience wrapper over verl's padded layout: (B, T) response-aligned importance, with the safe defaults of
    :func:`run_attribution` (a token budget, gradient checkpointing in OAR-G).

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
