"""One OAR training step, top to bottom, for every trainer.

Right after verl's old-log-prob pass, with the weights that computed the old log-probs, ``OARStep.attribute`` runs
steps 1-5 (``timing_s/oar``): (1) rows, (2) the base advantage, once, (3) selection (``rows.select_rows``), (4) the
workers' ``compute_token_importance`` RPC, (5) assembly into batch tensors (``rows.assemble``). ``OARStep.advantage``
is a context manager around verl's own advantage step: it opens the handoff (6: the ``oar`` estimator reshapes the
base advantage), then reports ``oar/*``, the fidelity and the token dump when due (7). The trainers only adapt verl's
batch to :class:`TrainerIO`. Details: docs/verl.md, "One step" and "Why a handoff".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from verl.utils.profiler import marked_timer

from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.step import due as fidelity_due
from oar_verl.core.fidelity.step import step_metrics
from oar_verl.core.reshaping.reshape import attribution_rows
from oar_verl.integration import dumps, handoff
from oar_verl.integration.estimator import base_advantage
from oar_verl.integration.fields import CONFIG_KEY, STEP_KEY
from oar_verl.integration.rows import BatchRows, StepAttribution, assemble, select_rows

TIMER = "oar"  # -> timing_s/oar (verl times the attribution call inside its old-log-prob pass)
FIDELITY_TIMER = "oar_fidelity"  # -> timing_s/oar_fidelity: the slowest rank's fidelity measurement (within oar's)


class TrainerIO(Protocol):
    """What a trainer adapter gives the step: its batch, its actor's data-parallel size and the worker RPC."""

    def rows(self, with_responses: bool) -> BatchRows:
        """The batch's rows (responses only when ``with_responses``: a token dump is due)."""

    def dp_size(self) -> int:
        """The actor's data-parallel size."""

    def compute_importance(self, rows: torch.Tensor, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Run the workers' ``compute_token_importance`` on ``rows`` (N,) with these per-call options; return its
        outputs padded to (N, T') / (N,)."""


class OARStep:
    """The OAR part of every training step of one run.

    Args:
        cfg: the validated OAR configuration.
        algorithm: verl's ``algorithm`` config (base estimator settings, KL-in-reward).
        tokenizer: the policy's tokenizer (token dumps).
        default_local_dir: ``trainer.default_local_dir`` (where dumps go unless ``algorithm.oar.dump_dir``).
    """

    def __init__(self, cfg: OARConfig, algorithm: Any, tokenizer, default_local_dir: str | None):
        self.cfg = cfg
        self.algorithm = algorithm
        self.tokenizer = tokenizer
        self.default_local_dir = default_local_dir

    def attribute(self, io: TrainerIO, global_step: int, timing_raw: dict) -> StepAttribution:
        """Steps 1-5, timed as ``timing_s/oar``: rows → base advantage → selection → worker RPC → assembly."""
        with marked_timer(TIMER, timing_raw, color="purple"):
            batch = io.rows(with_responses=dumps.due(self.cfg, global_step))
            base = self.base_advantage(batch)
            rows = select_rows(self.wanted(batch, base), batch.eligible, io.dp_size())
            out = io.compute_importance(rows, self.worker_options(global_step)) if len(rows) else None
            att = assemble(out, rows, batch, base)
        seconds = att.fidelity.get("seconds")
        if fidelity_due(self.cfg, global_step) and seconds is not None and not bool(seconds.isnan().all()):
            timing_raw[FIDELITY_TIMER] = float(seconds.nan_to_num(0.0).max())  # measured inside the workers
        return att

    @contextlib.contextmanager
    def advantage(self, att: StepAttribution, global_step: int, metrics: dict) -> Iterator[StepAttribution]:
        """Steps 6-7: the handoff open around verl's advantage step (the with-block), then ``oar/*`` into
        ``metrics``."""
        with handoff.scope(att.estimator_inputs) as opened:
            yield att
        metrics.update(self.report(att, opened.result, global_step))

    def base_advantage(self, batch: BatchRows) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The base estimator's (advantages, returns) on the batch's rewards, or None when verl will change the
        rewards first (a KL penalty in the reward): the estimator then computes them itself."""
        if self.algorithm.get("use_kl_in_reward", False):
            return None
        return base_advantage(batch.scores, batch.response_mask, batch.uids, self.algorithm, self.cfg)

    def wanted(self, batch: BatchRows, base: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """(B,) rows whose importance is needed: every row unless zero-advantage rows are skipped and the base
        advantage is known (with a KL penalty in the reward every row has a non-zero advantage)."""
        if base is None:
            return batch.eligible.clone()
        return attribution_rows(base[0], batch.response_mask, self.cfg, batch.eligible)

    def worker_options(self, global_step: int) -> dict[str, Any]:
        """Per-call options of the worker RPC (verl fixes the workers' init arguments)."""
        return {CONFIG_KEY: self.cfg.to_dict(), STEP_KEY: int(global_step)}

    def report(self, att: StepAttribution, result, global_step: int) -> dict[str, float]:
        """Step 7: ``oar/*`` metrics from the estimator's result, and the token dump when one is due."""
        if result is None:
            raise RuntimeError("oar: the advantage step did not run the `oar` estimator (algorithm.adv_estimator was "
                               "changed after start-up?)")
        response_mask = att.estimator_inputs.response_mask
        metrics = result.metrics(span_found=att.found[att.rows], answer_probe=att.answer_probe[att.rows])
        metrics["oar/attributed_seq_frac"] = len(att.rows.unique()) / max(int(response_mask.shape[0]), 1)
        metrics["oar/global_step"] = float(global_step)  # the step the probe schedule and the noise seeds used
        if len(att.passes) and bool((att.passes >= 0).all()):  # passes per data-parallel rank (the slowest sets it)
            metrics["oar/passes_max"], metrics["oar/passes_min"] = float(att.passes.max()), float(att.passes.min())
        counted = att.copies >= 0  # OAR-P rows whose masked copies were counted (docs/scaling.md: the cost model)
        if bool(counted.any()):
            reasoning = att.estimator_inputs.reasoning_mask.sum(-1).float()
            metrics["oar/perturbation_copies"] = float(att.copies[counted].sum())
            metrics["oar/refined_share"] = float(att.refined[counted].sum() / reasoning[counted].sum().clamp(min=1))
        if len(att.policy_match) and not bool(att.policy_match.isnan().any()):
            # 1: every rank attributed with exactly the weights its old-log-prob pass used (docs/verl.md)
            metrics["oar/policy_matches_old_log_prob"] = float(att.policy_match.min())
        if fidelity_due(self.cfg, global_step) and att.fidelity:  # docs/fidelity.md, "Logged while training"
            metrics.update(step_metrics(att.fidelity))
        if dumps.due(self.cfg, global_step) and att.batch.responses is not None and len(att.rows):
            dumps.dump_step(self.cfg, global_step, att, result, self.tokenizer, self.default_local_dir)
        return metrics
