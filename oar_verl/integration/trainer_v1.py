"""OAR on verl's default V1 trainer (TransferQueue): the registered trainer mode ``oar_sync``.

The adapter only moves data: verl's batch lives in TransferQueue and the driver holds keys (``KVBatchMeta``), so
:class:`V1IO` reads the step's fields from TransferQueue, sends the selected keys to the workers' RPC (whose outputs
TransferQueue stores under the same keys) and reads them back. The step itself is :mod:`oar_verl.integration.step`,
wrapped around verl's own ``_compute_advantage`` (vLLM is asleep by then, so attribution has the accelerator).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import open_dict
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

from oar_verl.integration.guard import uses_oar
from oar_verl.integration.rows import BatchRows
from oar_verl.integration.startup import validate_oar_setup
from oar_verl.integration.step import OARStep
from oar_verl.integration.worker import OUTPUT_FIELDS, actor_dp_size, swap_actor_worker

TRAINER_MODE = "oar_sync"


class V1IO:
    """The step's view of one V1 batch (``KVBatchMeta``) and the trainer's actor worker group."""

    def __init__(self, trainer: PPOTrainerSync, batch):
        self.trainer = trainer
        self.batch = batch

    def rows(self, with_responses: bool) -> BatchRows:
        fields = ["uid", "rm_scores", "response_mask"] + (["responses"] if with_responses else [])
        data = tq.kv_batch_get(keys=self.batch.keys, partition_id=self.batch.partition_id, select_fields=fields)
        padded = data.to_padded_tensor()
        uid = padded["uid"]  # a non-tensor field: a list-like of prompt uids
        uids = np.array(uid.tolist() if hasattr(uid, "tolist") else list(uid), dtype=object)
        # verl pads the batch to a multiple of the data-parallel size with tagged synthetic rows
        eligible = torch.tensor([not tag.get("is_padding", False) for tag in self.batch.tags], dtype=torch.bool)
        responses = padded["responses"].long() if with_responses else None
        return BatchRows(padded["response_mask"], padded["rm_scores"], uids, eligible, responses)

    def dp_size(self) -> int:
        return actor_dp_size(self.trainer.actor_rollout_wg)

    def compute_importance(self, rows: torch.Tensor, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        sub = self.batch.select_keys([self.batch.keys[i] for i in rows.tolist()])
        sub.extra_info = {**(self.batch.extra_info or {}), **options}
        self.trainer.actor_rollout_wg.compute_token_importance(sub)
        out = tq.kv_batch_get(keys=sub.keys, partition_id=sub.partition_id, select_fields=list(OUTPUT_FIELDS))
        return dict(out.to_padded_tensor().items())


@register_trainer(TRAINER_MODE)
class OARTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` plus OAR attribution; select with ``trainer.v1.trainer_mode=oar_sync``."""

    _oar_trainer = True

    def __init__(self, config):
        self.oar_config = validate_oar_setup(config) if uses_oar(config) else None
        self.oar_step: OARStep | None = None
        # upstream branches on `trainer_mode != "sync"` in several places (replay buffer, checkpoint restore, ...);
        # this trainer is the sync trainer
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)

    def on_init_end(self):
        super().on_init_end()
        if self.oar_config is not None:  # the tokenizer exists from here on
            self.oar_step = OARStep(self.oar_config, self.config.algorithm, self.tokenizer,
                                    self.config.trainer.get("default_local_dir"))

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        swap_actor_worker(self.role_worker_mapping)

    def _compute_advantage(self, batch, metrics: dict):
        if self.oar_step is None:
            return super()._compute_advantage(batch, metrics)
        with self.oar_step.around_advantage(V1IO(self, batch), self.global_steps, self.timing_raw, metrics):
            batch = super()._compute_advantage(batch, metrics)
        return batch
