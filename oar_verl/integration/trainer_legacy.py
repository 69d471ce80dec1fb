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
from oar_verl.integration.trainer_common import (WORKER_FIELDS, StepAttribution, actor_dp_size, assemble,
                                                 attribution_options, finish_step, select_rows, swap_actor_worker,
                                                 uses_oar, validate_oar_setup)


class OARRayPPOTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` plus OAR attribution between the old-log-prob pass and the advantage step."""

    _oar_trainer = True

    def __init__(self, config, *args, **kwargs):
        self.oar_config = validate_oar_setup(config) if uses_oar(config) else None
        self._oar_step: StepAttribution | None = None
        self._oar_seconds = 0.0
        super().__init__(config, *args, **kwargs)

    def _compute_old_log_prob(self, batch):
        result = super()._compute_old_log_prob(batch)
        if self.oar_config is not None:
            start = time.perf_counter()
            self._oar_step = self._attribute(batch)
            handoff.put(self._oar_step.pending)
            self._oar_seconds = time.perf_counter() - start
        return result

    def _attribute(self, batch) -> StepAttribution:
        cfg = self.oar_config
        response_mask = batch.batch["response_mask"]
        B = response_mask.shape[0]
        uids = np.asarray(batch.non_tensor_batch["uid"], dtype=object)
        if "rm_scores" in batch.batch.keys():
            scores = batch.batch["rm_scores"]
            rows = select_rows(cfg, self.config.algorithm, scores, response_mask, uids, torch.ones(B, dtype=torch.bool),
                               actor_dp_size(self.actor_rollout_wg))
        else:  # reward not in the batch yet: attribute every row
            scores, rows = torch.zeros_like(response_mask, dtype=torch.float32), torch.arange(B)
        out = None
        if len(rows):
            td = left_right_2_no_padding(batch.select_idxs(rows.numpy()).to_tensordict())
            tu.assign_non_tensor(td, **attribution_options(cfg, self.global_steps))
            nested = self.actor_rollout_wg.compute_token_importance(td)
            out = {k: (nested[k].to_padded_tensor(0.0) if nested[k].is_nested else nested[k]) for k in WORKER_FIELDS}
        return assemble(out, rows, response_mask, scores.sum(-1), uids, batch.batch["responses"])

    def _update_actor(self, batch):
        # the legacy fit() keeps its metric and timing dicts local: report ours with the actor-update metrics
        output = super()._update_actor(batch)
        if self.oar_config is not None and self._oar_step is not None:
            metrics = output.meta_info["metrics"]
            metrics.update(finish_step(self.oar_config, self.global_steps, self._oar_step, self.tokenizer,
                                       self.config.trainer.get("default_local_dir")))
            metrics["timing_s/oar"] = self._oar_seconds
            self._oar_step = None
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
