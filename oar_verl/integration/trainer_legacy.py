"""OAR on verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``).

``main_ppo`` hard-codes its legacy TaskRunner, so :mod:`oar_verl.main` runs :class:`OARTaskRunner`, which maps the
OAR worker and builds :class:`OARRayPPOTrainer`. That trainer attributes right after the old-log-prob pass, hands
the importance to the ``oar`` estimator for verl's own advantage step, and reports ``oar/*`` metrics and
``timing_s/oar`` with the actor-update metrics (the legacy ``fit`` keeps its metric dicts local).
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from oar_verl.integration import handoff
from oar_verl.integration.trainer_common import (actor_dp_size, attribution_options, scatter_rows, select_rows,
                                                 step_metrics, swap_actor_worker, uses_oar, validate_oar_setup)


class OARRayPPOTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` plus OAR attribution between the old-log-prob pass and the advantage step."""

    _oar_trainer = True

    def __init__(self, config, *args, **kwargs):
        self.oar_config = validate_oar_setup(config) if uses_oar(config) else None
        self._oar_pending: handoff.PendingImportance | None = None
        self._oar_step_info: tuple | None = None
        super().__init__(config, *args, **kwargs)

    def _compute_old_log_prob(self, batch):
        result = super()._compute_old_log_prob(batch)
        if self.oar_config is not None:
            start = time.perf_counter()
            pending, found, probe, n_attr = self._attribute(batch)
            handoff.put(pending)
            self._oar_step_info = (pending.response_mask, found, probe, n_attr, time.perf_counter() - start)
        return result

    def _attribute(self, batch):
        cfg = self.oar_config
        response_mask = batch.batch["response_mask"]
        B, T = response_mask.shape
        uids = np.asarray(batch.non_tensor_batch["uid"], dtype=object)
        scores = batch.batch["rm_scores"] if "rm_scores" in batch.batch.keys() else None
        eligible = torch.ones(B, dtype=torch.bool)
        if scores is None:  # reward not computed yet (e.g. reward model outside the batch): attribute every row
            rows = torch.arange(B)
        else:
            rows = select_rows(cfg, self.config.algorithm, scores, response_mask, uids, eligible,
                               actor_dp_size(self.actor_rollout_wg))
        importance = torch.zeros(B, T)
        reasoning = torch.zeros(B, T, dtype=torch.bool)
        found = probe = torch.zeros(0, dtype=torch.bool)
        attributed = torch.zeros(B, dtype=torch.bool)
        if len(rows):
            sub = batch.select_idxs(rows.numpy())
            td = left_right_2_no_padding(sub.to_tensordict())
            tu.assign_non_tensor(td, **attribution_options(cfg, self.global_steps))
            out = self.actor_rollout_wg.compute_token_importance(td)
            importance = scatter_rows(out["token_importance"].to_padded_tensor(0.0).float(), rows, B, T)
            reasoning = scatter_rows(out["oar_reasoning_mask"].to_padded_tensor(0.0).bool(), rows, B, T, fill=False)
            found, probe = out["oar_span_found"].bool(), out["oar_answer_probe"].bool()
            attributed[rows] = True
        pending = handoff.PendingImportance(importance, reasoning & response_mask.bool(), attributed, response_mask)
        return pending, found, probe, len(rows)

    def _update_actor(self, batch):
        output = super()._update_actor(batch)
        if self.oar_config is not None and self._oar_step_info is not None:
            response_mask, found, probe, n_attr, seconds = self._oar_step_info
            result = handoff.pop_result()
            if result is not None:
                output.meta_info["metrics"].update(step_metrics(result, response_mask, found, probe, n_attr))
            output.meta_info["metrics"]["timing_s/oar"] = seconds
            self._oar_step_info = None
        return output


class OARTaskRunnerImpl(BaseTaskRunner):
    """verl's legacy TaskRunner with the OAR worker and trainer.

    verl's ``TaskRunner`` is a Ray actor class; its underlying class is not importable by name, so a subclass would
    be pickled by value and break its ``super()`` calls in the Ray worker. This class extends the importable base and
    borrows ``TaskRunner.run`` at call time instead.
    """

    def add_actor_rollout_worker(self, config):
        cls, group_cls = super().add_actor_rollout_worker(config)
        swap_actor_worker(self.role_worker_mapping)
        return cls, group_cls

    def run(self, config):
        import verl.trainer.main_ppo_v0 as v0

        # the legacy run() builds `RayPPOTrainer` by module-level name; point it at the OAR trainer in this process
        v0.RayPPOTrainer = OARRayPPOTrainer
        return v0.TaskRunner.__ray_actor_class__.run(self, config)


OARTaskRunner = ray.remote(num_cpus=1)(OARTaskRunnerImpl)
