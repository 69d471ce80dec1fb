"""OAR on verl's default V1 trainer (TransferQueue): the registered trainer mode ``oar_sync``.

Per step, between the old-log-prob pass and the advantage step: compute the base advantage, send only rows with a
non-zero advantage to ``compute_token_importance`` on the actor workers (vLLM is asleep then), hand the importance
to the ``oar`` estimator, and let verl's own ``_compute_advantage`` run (KL-in-reward, rollout correction and
multi-trajectory handling stay upstream's).
"""

from __future__ import annotations

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import open_dict
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils.profiler import marked_timer

from oar_verl.integration import handoff
from oar_verl.integration.trainer_common import (actor_dp_size, attribution_options, install_stock_trainer_guard,
                                                 scatter_rows, select_rows, step_metrics, swap_actor_worker, uses_oar,
                                                 validate_oar_setup)

TRAINER_MODE = "oar_sync"

_IMPORTANCE_FIELDS = ["token_importance", "oar_reasoning_mask", "oar_span_found", "oar_answer_probe"]


@register_trainer(TRAINER_MODE)
class OARTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` plus OAR attribution; select with ``trainer.v1.trainer_mode=oar_sync``."""

    _oar_trainer = True

    def __init__(self, config):
        self.oar_config = validate_oar_setup(config) if uses_oar(config) else None
        # upstream branches on `trainer_mode != "sync"` in several places (replay buffer, checkpoint restore, ...);
        # this trainer is the sync trainer
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        swap_actor_worker(self.role_worker_mapping)

    def _compute_advantage(self, batch, metrics: dict):
        if self.oar_config is None:
            return super()._compute_advantage(batch, metrics)
        with marked_timer("oar", self.timing_raw, color="purple"):
            pending, found, probe, n_attr = self._attribute(batch)
        handoff.put(pending)
        try:
            batch = super()._compute_advantage(batch, metrics)
        finally:
            handoff.take(pending.response_mask)  # never leave a stale handoff behind
        result = handoff.pop_result()
        metrics.update(step_metrics(result, pending.response_mask, found, probe, n_attr))
        return batch

    def _attribute(self, batch):
        cfg = self.oar_config
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["uid", "rm_scores", "response_mask"])
        padded = data.to_padded_tensor()
        response_mask = padded["response_mask"]
        B, T = response_mask.shape
        uid = padded["uid"]  # a non-tensor field: a list-like of prompt uids
        uids = np.array(uid.tolist() if hasattr(uid, "tolist") else list(uid), dtype=object)
        eligible = torch.tensor([not tag.get("is_padding", False) for tag in batch.tags], dtype=torch.bool)
        rows = select_rows(cfg, self.config.algorithm, padded["rm_scores"], response_mask, uids, eligible,
                           actor_dp_size(self.actor_rollout_wg))
        importance = torch.zeros(B, T)
        reasoning = torch.zeros(B, T, dtype=torch.bool)
        found = probe = torch.zeros(0, dtype=torch.bool)  # over the attributed rows
        attributed = torch.zeros(B, dtype=torch.bool)
        if len(rows):
            sub = batch.select_keys([batch.keys[i] for i in rows.tolist()])
            sub.extra_info = {**(batch.extra_info or {}), **attribution_options(cfg, self.global_steps)}
            self.actor_rollout_wg.compute_token_importance(sub)
            out = tq.kv_batch_get(keys=sub.keys, partition_id=sub.partition_id, select_fields=_IMPORTANCE_FIELDS)
            out = out.to_padded_tensor()
            importance = scatter_rows(out["token_importance"].float(), rows, B, T)
            reasoning = scatter_rows(out["oar_reasoning_mask"].bool(), rows, B, T, fill=False)
            found, probe = out["oar_span_found"].bool(), out["oar_answer_probe"].bool()
            attributed[rows] = True
        pending = handoff.PendingImportance(importance, reasoning & response_mask.bool(), attributed, response_mask)
        return pending, found, probe, len(rows)


install_stock_trainer_guard()
