"""What the V1 and legacy OAR trainers share: start-up validation, worker swap, row selection, metrics."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import ray
import torch
from omegaconf import DictConfig

from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.metrics import oar_metrics
from oar_verl.integration import dumps, handoff
from oar_verl.integration.estimator import (ESTIMATOR_NAME, RUN_HINT, OARSetupError, base_advantage, oar_config,
                                            rows_to_reshape, sequence_advantage)
from oar_verl.integration.worker import CONFIG_KEY, STEP_KEY, OARActorRolloutRefWorker

logger = logging.getLogger("oar_verl")

SUPPORTED_STRATEGIES = ("fsdp", "fsdp2", "megatron")


def uses_oar(config: DictConfig) -> bool:
    return config.algorithm.get("adv_estimator", None) == ESTIMATOR_NAME


def validate_oar_setup(config: DictConfig) -> OARConfig:
    """Check everything OAR needs at start-up, before any rollout; returns the validated OARConfig.

    Raises:
        OARConfigError: an invalid ``algorithm.oar.*`` value (the message names the key and the allowed range).
        OARSetupError: a verl setting OAR cannot run with (e.g. the Megatron strategy).
    """
    cfg = oar_config(config.algorithm)
    actor = config.actor_rollout_ref.actor
    strategy = actor.get("strategy", "fsdp")
    if strategy not in SUPPORTED_STRATEGIES:
        raise OARSetupError(f"actor_rollout_ref.actor.strategy={strategy!r} is not supported by OAR yet (supported: "
                            f"{', '.join(SUPPORTED_STRATEGIES)})")
    if strategy == "megatron":
        from oar_verl.integration.megatron_attribution import megatron_layout_error

        model = config.actor_rollout_ref.model
        msg = megatron_layout_error(actor.get("megatron", {}),
                                    mtp_enabled=bool(model.get("mtp", {}).get("enable", False)),
                                    use_fused_kernels=bool(model.get("use_fused_kernels", False)))
        if msg is not None:
            raise OARSetupError(msg)
    if cfg.base_estimator in ("gae",):
        raise OARConfigError(f"{cfg.prefix}.base_estimator='gae' needs a critic; OAR reshapes outcome advantages "
                             "(grpo, rloo, reinforce_plus_plus, ...)")
    rollout_corr = config.algorithm.get("rollout_correction", None)
    if rollout_corr is not None and rollout_corr.get("bypass_mode", False):
        raise OARSetupError("algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass that OAR "
                            "attributes after; set it to false")
    return cfg


def install_stock_trainer_guard() -> None:
    """Make verl's own trainers refuse ``adv_estimator=oar`` at construction, before any rollout.

    Without the OAR trainer nothing computes token importance, and the failure would otherwise come only at the
    first advantage step, after a full rollout.
    """
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    for cls in (PPOTrainer, RayPPOTrainer):
        original = cls.__init__
        if getattr(original, "_oar_guard", False):
            continue

        @functools.wraps(original)
        def guarded(self, config, *args, __original=original, **kwargs):
            if uses_oar(config) and not getattr(self, "_oar_trainer", False):
                raise OARSetupError(f"algorithm.adv_estimator=oar was selected with verl's stock trainer "
                                    f"{type(self).__name__}, which cannot compute token importance.\n" + RUN_HINT)
            __original(self, config, *args, **kwargs)

        guarded._oar_guard = True
        cls.__init__ = guarded


def swap_actor_worker(role_worker_mapping: dict) -> None:
    """Replace verl's ActorRolloutRefWorker by the OAR worker for every actor role present."""
    from verl.trainer.ppo.utils import Role

    for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
        if role in role_worker_mapping:
            role_worker_mapping[role] = ray.remote(OARActorRolloutRefWorker)


def actor_dp_size(worker_group) -> int:
    """Data-parallel size of the actor mesh of a verl worker group (as verl's own batch balancing reads it)."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


def select_rows(cfg: OARConfig, algorithm: DictConfig, scores: torch.Tensor, response_mask: torch.Tensor,
                uids: np.ndarray, eligible: torch.Tensor, multiple: int) -> torch.Tensor:
    """Rows to attribute: non-zero base advantage (and ``apply_to``), padded to a multiple of the DP size.

    Args:
        scores: (B, T) token-level outcome scores; response_mask (B, T); uids (B,) prompt ids.
        eligible: (B,) bool rows that may be attributed (not verl's synthetic padding rows).
        multiple: the data-parallel size; the selection is topped up with other eligible rows to a multiple of it
            so that every rank gets an equal share.

    Returns:
        (N,) long sorted row indices (empty when nothing needs attribution).
    """
    if cfg.skip_zero_advantage and not algorithm.get("use_kl_in_reward", False):
        base, _ = base_advantage(scores, response_mask, uids, algorithm, cfg)
        wanted = rows_to_reshape(sequence_advantage(base, response_mask), cfg.apply_to) & eligible
    else:  # with KL in the reward every row has a non-zero advantage
        wanted = eligible.clone()
    idx = wanted.nonzero().squeeze(1)
    if len(idx) == 0:
        return idx
    short = (-len(idx)) % multiple
    if short:
        fill = ((~wanted) & eligible).nonzero().squeeze(1)[:short]
        if len(fill) < short:  # not enough other real rows: use padding rows, then any rows
            fill = torch.cat([fill, (~wanted & ~eligible).nonzero().squeeze(1)])[:short]
        idx = torch.cat([idx, fill]).sort().values
    return idx


def attribution_options(cfg: OARConfig, global_step: int) -> dict:
    """Per-call options for the worker (the worker's init arguments are fixed by verl)."""
    return {CONFIG_KEY: cfg.to_dict(), STEP_KEY: int(global_step)}


# what compute_token_importance returns per row (nested, response-aligned) and per sequence
WORKER_FIELDS = ("token_importance", "oar_reasoning_mask", "oar_answer_mask", "oar_span_found", "oar_answer_probe")


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, n_rows: int, width: int, fill=0.0) -> torch.Tensor:
    """(n_rows, width) tensor with ``values`` (len(rows), w <= width) placed at ``rows``; ``fill`` elsewhere."""
    out = torch.full((n_rows, width), fill, dtype=values.dtype)
    out[rows, : values.shape[1]] = values
    return out


@dataclass
class StepAttribution:
    """One step's attribution, in the batch's row order.

    Attributes:
        pending: what the estimator takes (importance, reasoning mask, attributed rows, response mask), (B, T).
        rows: (N,) attributed row indices.
        answer: (B, T) bool answer-span tokens. found, answer_probe: (B,) bool.
        scores: (B,) sequence rewards. uids: (B,) prompt ids. responses: (B, T) ids, only on dump steps.
    """

    pending: handoff.PendingImportance
    rows: torch.Tensor
    answer: torch.Tensor
    found: torch.Tensor
    answer_probe: torch.Tensor
    scores: torch.Tensor
    uids: np.ndarray
    responses: torch.Tensor | None = None


def assemble(out: dict | None, rows: torch.Tensor, response_mask: torch.Tensor, scores: torch.Tensor,
             uids: np.ndarray, responses: torch.Tensor | None = None) -> StepAttribution:
    """Scatter the worker's padded (N, T') outputs for ``rows`` into (B, T) batch tensors."""
    B, T = response_mask.shape
    attributed = torch.zeros(B, dtype=torch.bool)
    importance, reasoning = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    answer = torch.zeros(B, T, dtype=torch.bool)
    found, probe = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    if out is not None and len(rows):
        importance = scatter_rows(out["token_importance"].float(), rows, B, T)
        reasoning = scatter_rows(out["oar_reasoning_mask"].bool(), rows, B, T, fill=False)
        answer = scatter_rows(out["oar_answer_mask"].bool(), rows, B, T, fill=False)
        found[rows], probe[rows] = out["oar_span_found"].bool(), out["oar_answer_probe"].bool()
        attributed[rows] = True
    pending = handoff.PendingImportance(importance, reasoning & response_mask.bool(), attributed, response_mask)
    return StepAttribution(pending, rows, answer, found, probe, scores, uids, responses)


def finish_step(cfg: OARConfig, step: int, att: StepAttribution, tokenizer, default_local_dir: str | None
                ) -> dict[str, float]:
    """oar/* metrics of the step from the estimator's result, and the token dump when one is due."""
    result = handoff.pop_result()
    if result is None:
        raise RuntimeError("oar: the advantage step did not run the `oar` estimator (algorithm.adv_estimator was "
                           "changed after start-up?)")
    response_mask = att.pending.response_mask
    metrics = oar_metrics(result.token_weights, result.base_advantages, result.advantages, response_mask,
                          span_found=att.found[att.rows], answer_probe=att.answer_probe[att.rows])
    metrics["oar/attributed_seq_frac"] = len(att.rows) / max(int(response_mask.shape[0]), 1)
    if dumps.due(cfg, step) and att.responses is not None and len(att.rows):
        rows = dumps.pick_groups(att.uids, att.pending.attributed, cfg.dump_groups)
        dumps.write_dump(dumps.dump_dir(cfg, default_local_dir) / f"step_{step}.jsonl", step, rows, att.uids,
                         att.scores, sequence_advantage(result.base_advantages, response_mask), att.responses,
                         response_mask, att.pending.token_importance, result.token_weights.weights,
                         att.pending.reasoning_mask, att.answer, att.found, tokenizer)
    return metrics
