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

from oar_verl.integration import dumps, handoff
from oar_verl.integration.trainer_common import (WORKER_FIELDS, StepAttribution, actor_dp_size, assemble,
                                                 attribution_options, finish_step, install_stock_trainer_guard,
                                                 scatter_rows, select_rows, swap_actor_worker, uses_oar,
                                                 validate_oar_setup)

TRAINER_MODE = "oar_sync"


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
            att = self._attribute(batch)
        handoff.put(att.pending)
        try:
            batch = super()._compute_advantage(batch, metrics)
        finally:
            handoff.take(att.pending.response_mask)  # never leave a stale handoff behind
        metrics.update(finish_step(self.oar_config, self.global_steps, att, self.tokenizer,
                                   self.config.trainer.get("default_local_dir")))
        return batch

    def _attribute(self, batch) -> StepAttribution:
        cfg = self.oar_config
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["uid", "rm_scores", "response_mask"])
        padded = data.to_padded_tensor()
        response_mask = padded["response_mask"]
        uid = padded["uid"]  # a non-tensor field: a list-like of prompt uids
        uids = np.array(uid.tolist() if hasattr(uid, "tolist") else list(uid), dtype=object)
        eligible = torch.tensor([not tag.get("is_padding", False) for tag in batch.tags], dtype=torch.bool)
        rows = select_rows(cfg, self.config.algorithm, padded["rm_scores"], response_mask, uids, eligible,
                           actor_dp_size(self.actor_rollout_wg))
        out = responses = None
        if len(rows):
            sub = batch.select_keys([batch.keys[i] for i in rows.tolist()])
            sub.extra_info = {**(batch.extra_info or {}), **attribution_options(cfg, self.global_steps)}
            self.actor_rollout_wg.compute_token_importance(sub)
            dump = dumps.due(cfg, self.global_steps)
            fields = list(WORKER_FIELDS) + (["responses"] if dump else [])
            out = tq.kv_batch_get(keys=sub.keys, partition_id=sub.partition_id, select_fields=fields)
            out = out.to_padded_tensor()
            if dump:
                responses = scatter_rows(out["responses"].long(), rows, *response_mask.shape, fill=0)
        return assemble(out, rows, response_mask, padded["rm_scores"].sum(-1), uids, responses)


install_stock_trainer_guard()
