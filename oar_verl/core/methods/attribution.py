"""Running the configured method: :func:`run_attribution` runs ``algorithm.oar.mode`` (looked up in
:data:`~oar_verl.core.methods.contract.METHODS`) on a backend; :func:`module_backend` makes the backend of a Hugging
Face module (plain, FSDP or sequence-sharded), with the worker's safe settings (a token budget, gradient
checkpointing in backward passes); :func:`response_importance` does both on verl's padded layout.

Token rows go through :func:`oar_verl.core.pipeline.attribute` (the one way in, for every integration), which
prepares them (:func:`oar_verl.core.preprocess.prepare_attribution`) and calls :func:`run_attribution`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# the methods register themselves in METHODS when imported
import oar_verl.core.methods.conservative  # noqa: F401
import oar_verl.core.methods.fisher  # noqa: F401
import oar_verl.core.methods.gradient  # noqa: F401
import oar_verl.core.methods.path  # noqa: F401
import oar_verl.core.methods.policies  # noqa: F401
from oar_verl.core.backends.base import AttributionBackend, ProbeTable
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.ulysses import SequenceShards, UlyssesBackend
from oar_verl.core.backends.budget import Fits, PassLimits
from oar_verl.core.backends.shared import SharedAttribution, SharedTeacher
from oar_verl.core.checks.startup import check_config, require_resolved
from oar_verl.core.config import AUTO_MODE, OARConfig
from oar_verl.core.batch.layout import AttributionBatch, build_attribution_batch, with_segments
from oar_verl.core.methods.contract import METHODS, AttributionResult, MethodInputs
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.registry import Registry

__all__ = ["AttributionResult", "DEFAULT_MAX_TOKENS", "METHODS", "module_backend", "pass_limits", "probe_kinds",
           "response_importance", "run_attribution", "shared_attribution", "shared_modes"]

# the budget when neither the configuration nor the trainer gives one (core-only use): a typical verl
# ppo_max_token_len_per_gpu
DEFAULT_MAX_TOKENS = 16384

# how a Hugging Face module's sequences are laid out in a pass: whole (plain or FSDP), or sharded over a Ulysses group
MODULE_BACKENDS: Registry[Callable[..., AttributionBackend]] = Registry("module layout", "sequence parallelism")


@MODULE_BACKENDS.register("whole")
def _whole(model, cfg: OARConfig, limits: PassLimits, *, checkpointing: bool, align, shards, pad_id: int):
    return ModuleBackend(model, limits, prefix_cache=cfg.prefix_cache, checkpointing=checkpointing, align=align)


@MODULE_BACKENDS.register("ulysses")
def _ulysses(model, cfg: OARConfig, limits: PassLimits, *, checkpointing: bool, align, shards, pad_id: int):
    return UlyssesBackend(model, limits, shards, pad_id=pad_id, checkpointing=checkpointing, align=align)


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


def module_backend(model: torch.nn.Module | None, cfg: OARConfig, *, limits: PassLimits | None = None,
                   checkpointing: bool = True, align: Callable[[int], int] | None = None,
                   shards: SequenceShards | None = None, pad_id: int = 0) -> AttributionBackend:
    """The backend of a Hugging Face causal LM (:mod:`oar_verl.core.backends.hf`,
    :mod:`oar_verl.core.backends.ulysses`).

    Args:
        model: the causal LM in eval mode (plain or FSDP-wrapped; with ``shards``: sharded over a Ulysses group);
            None for planning only.
        cfg: OARConfig (``prefix_cache``).
        limits: the token budget of one pass (default: :func:`pass_limits` of ``cfg``: 16,384 tokens unless the
            config says otherwise).
        checkpointing: checkpoint the decoder layers in backward passes (the actor's setting; ``False`` only when
            memory is plentiful: it saves one recomputed forward per backward pass).
        align: maps this rank's pass count to the count every data-parallel rank runs (the max over ranks), called
            once per level on every rank alike; None: a single rank.
        shards: a Ulysses sequence-parallel group: every pass is sharded over it; None: whole sequences.
        pad_id: the token filling the last shard (with ``shards``).
    """
    make = MODULE_BACKENDS.get("whole" if shards is None else "ulysses")
    return make(model, cfg, limits or pass_limits(cfg), checkpointing=checkpointing, align=align, shards=shards,
                pad_id=pad_id)


def run_attribution(backend: AttributionBackend, batch: AttributionBatch, cfg: OARConfig, *,
                    mask_token_id: int | None = None, seeds: torch.Tensor | None = None,
                    teachers: ProbeTable | None = None) -> AttributionResult:
    """Importance of the batch's reasoning tokens with the configured method, on any backend.

    Args:
        backend: a model runtime: :func:`module_backend` of a Hugging Face module, or verl's Megatron engine's
            (``oar_verl.integration.megatron.backend.MegatronBackend``).
        batch: AttributionBatch (B, L) (with ``segments`` for OAR-P's segment-level policies).
        cfg: OARConfig; ``cfg.mode`` names the method.
        mask_token_id: the mask token (OAR-P, fisher).
        seeds: (B,) int64 noise seeds (OAR-G).
        teachers: every row's clean probe read from a forward that ran anyway (:meth:`SharedTeacher.teachers`, a
            method with ``shared_teacher``); None: the method runs its own clean passes.

    Returns:
        AttributionResult: (B, L) float32 importance (0 off the reasoning tokens) and what ran.
    """
    check_config(require_resolved(cfg))  # the names and their combinations (core-only users have no start-up)
    return METHODS.get(cfg.mode).run(backend, batch, cfg, MethodInputs(mask_token_id, seeds, teachers))


def shared_modes(teacher: bool = False) -> tuple[str, ...]:
    """The registered methods that can read their scores from a forward the trainer runs anyway, and with
    ``teacher`` those that read their clean teachers from it (``Method.shared_teacher``)."""
    return tuple(name for name in METHODS.names()
                 if METHODS.get(name).shared is not None or (teacher and METHODS.get(name).shared_teacher))


def shared_mode(cfg: OARConfig, steady: str | None = None, *, teacher: bool = True) -> str | None:
    """The mode that reads its scores (or, with ``teacher``, its clean teachers) from a forward the trainer runs
    anyway (``shared_forward``; docs/method.md §14), or None: ``cfg.mode`` when it can share; under ``mode=auto`` the
    selector's ``steady`` mode of the step (:meth:`~oar_verl.core.auto.AutoSelector.steady_mode`: no calibration,
    one mode for every band) when it can. Never with ``target=reference``: its rows end in the ground truth, which
    the trainer's forward of the model's own rows does not hold."""
    if not cfg.shared_forward or cfg.target == "reference":
        return None
    mode = steady if cfg.mode == AUTO_MODE else cfg.mode
    return mode if mode in shared_modes(teacher) else None


def shared_attribution(model: torch.nn.Module, batch: AttributionBatch, cfg: OARConfig,
                       recompute: Callable[[int], float] | bool, *, mask_token_id: int | None = None,
                       seeds: torch.Tensor | None = None, shards: SequenceShards | None = None
                       ) -> SharedAttribution | SharedTeacher:
    """What the configured method reads from the caller's forwards of ``batch``'s rows on ``model`` (a Hugging Face
    causal LM, plain or FSDP-wrapped), run inside its ``forward`` (under Ulysses, ``shards``: each rank's forward one
    shard of the packed rows): its scores (:class:`~oar_verl.core.backends.shared.SharedAttribution`), or its clean
    teachers (:class:`~oar_verl.core.backends.shared.SharedTeacher`, a method with ``shared_teacher``; pass
    :meth:`~oar_verl.core.backends.shared.SharedTeacher.teachers` to :func:`run_attribution`).

    Raises:
        ValueError: ``cfg.mode`` runs all its own passes (naming the modes that share).
    """
    entry = METHODS.get(require_resolved(cfg).mode)
    if entry.shared_teacher:
        return SharedTeacher(model, batch, shards)
    if entry.shared is None:
        raise ValueError(f"{cfg.prefix}.mode={cfg.mode} cannot read its scores or its teachers from the old-log-prob "
                         f"forward (it runs its own passes); the modes that can: {', '.join(shared_modes(True))}")
    target = entry.shared(module_backend(model, cfg), batch, cfg, MethodInputs(mask_token_id, seeds))
    return SharedAttribution(model, target, recompute, shards)


def response_importance(model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                        responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                        answer_mask: torch.Tensor, cfg: OARConfig, *, global_step: int = 0,
                        mask_token_id: int | None = None, seeds: torch.Tensor | None = None,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
    """Convenience wrapper over verl's padded layout: (B, T) response-aligned importance, with the safe defaults of
    :func:`module_backend` (a token budget, gradient checkpointing in backward passes).

    Args:
        prompts: (B, P) left-padded.
        prompt_mask: (B, P).
        responses: (B, T) right-padded.
        response_mask: (B, T).
        reasoning_mask: (B, T) bool (from :func:`oar_verl.core.text.spans.locate_answer_spans`).
        answer_mask: (B, T) bool.
        cfg: OARConfig.
        global_step: selects the probe (``probe=auto``).
        mask_token_id: OAR-P mask token.
        seeds: (B,) OAR-G noise seeds.
        segments: (B, T) long reasoning-segment ids (:func:`oar_verl.core.text.segments.reasoning_segments`), needed by
            OAR-P's segment-level policies.
    """
    kinds = probe_kinds(cfg, global_step, prompts.shape[0], prompts.device)
    batch = build_attribution_batch(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                    kinds)
    if segments is not None:
        batch = with_segments(batch, segments)
    return run_attribution(module_backend(model, cfg), batch, cfg, mask_token_id=mask_token_id,
                           seeds=seeds).importance[:, batch.response_start:]
