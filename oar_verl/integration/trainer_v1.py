"""OAR on verl's V1 trainers (TransferQueue), every mode: ``oar_sync``, ``oar_colocate_async``, ``oar_separate_async``.

A mode's OAR trainer is ``(OARTrainerMixin, <verl's mode class>, OARStepLayer)``, without copying verl's: the mixin
validates the configuration, keeps ``trainer.v1.trainer_mode`` at verl's name and swaps in OAR's actor worker; the
layer attributes inside the old-log-prob pass (so with π_old's weights, also in ``separate_async``) and opens the
handoff around ``_compute_advantage``. :class:`V1IO` only moves data between TransferQueue and the step
(:mod:`oar_verl.integration.step`). Why: docs/verl.md, "Why a trainer subclass, and one for every mode".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from omegaconf import open_dict
from verl.trainer.ppo.v1 import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from oar_verl.integration.guard import uses_oar
from oar_verl.integration.rows import BatchRows, call_seconds, session_finals
from oar_verl.integration.startup import validate_mask_token, validate_oar_setup
from oar_verl.integration.step import OARStep, checkpoint_folder, model_window, multi_turn_enabled
from oar_verl.integration.fields import ATTRIBUTE_FIELD, OUTPUT_FIELDS, SECONDS_FIELD, SHARED_KEY
from oar_verl.integration.worker import actor_dp_size, swap_actor_worker

# verl's V1 trainer modes OAR runs on, and the OAR trainer mode registered for each
MODES = ("sync", "colocate_async", "separate_async")
OAR_MODE_PREFIX = "oar_"


class V1IO:
    """The step's view of one V1 batch (``KVBatchMeta``) and the trainer's actor worker group; with ``shared``, the
    workers already stored every row's importance fields with the old log-probs (no RPC)."""

    def __init__(self, trainer: PPOTrainer, batch, shared: bool = False):
        self.trainer = trainer
        self.batch = batch
        self.shared = shared

    def rows(self, with_responses: bool) -> BatchRows:
        auto = self.trainer.oar_step is not None and self.trainer.oar_step.selector is not None
        # the responses always: their lengths hold the tool outputs of a multi-turn row (response_mask is 0 there)
        fields = ["uid", "rm_scores", "response_mask", "responses"] + (["prompts"] if auto else [])
        data = tq.kv_batch_get(keys=self.batch.keys, partition_id=self.batch.partition_id, select_fields=fields)
        lengths = None
        if auto:  # mode=auto: each row's prompt + response tokens (its sliding-window band, the update's tokens)
            prompts = data["prompts"]
            plen = (torch.tensor([p.numel() for p in prompts.unbind()]) if prompts.is_nested  # per row, not token
                    else torch.full((prompts.shape[0],), prompts.shape[1]))  # padded: the padded width, an upper bound
        raw = data["responses"]
        # each row's response tokens, tool outputs too (per row, not per token)
        rlen = torch.tensor([r.numel() for r in raw.unbind()], dtype=torch.long) if raw.is_nested else None
        padded = data.to_padded_tensor()
        width = padded["response_mask"].shape[1]
        valid = (torch.arange(width)[None, :] < rlen[:, None] if rlen is not None
                 else padded["response_mask"].bool())  # padded: no lengths held beyond the mask
        if auto:
            lengths = plen.long().cpu() + valid.sum(-1).long().cpu()
        uid = padded["uid"]  # a non-tensor field: a list-like of prompt uids
        uids = np.array(uid.tolist() if hasattr(uid, "tolist") else list(uid), dtype=object)
        # verl pads the batch to a multiple of the data-parallel size with tagged synthetic rows
        eligible = torch.tensor([not tag.get("is_padding", False) for tag in self.batch.tags], dtype=torch.bool)
        responses = padded["responses"].long() if with_responses else None
        return BatchRows(padded["response_mask"], padded["rm_scores"], uids, eligible, responses, lengths, valid,
                         session_finals(self.batch.keys))

    def dp_size(self) -> int:
        return actor_dp_size(self.trainer.actor_rollout_wg)

    def compute_importance(self, rows: torch.Tensor, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        sub = self.batch.select_keys([self.batch.keys[i] for i in rows.tolist()])
        if not self.shared:
            sub.extra_info = {**(self.batch.extra_info or {}), **options}
            self.trainer.actor_rollout_wg.compute_token_importance(sub)
        out = tq.kv_batch_get(keys=sub.keys, partition_id=sub.partition_id, select_fields=list(OUTPUT_FIELDS))
        return dict(out.to_padded_tensor().items())

    def call_seconds(self) -> float:
        if not self.shared:
            return 0.0
        out = tq.kv_batch_get(keys=self.batch.keys, partition_id=self.batch.partition_id, select_fields=[SECONDS_FIELD])
        return call_seconds(dict(out.to_padded_tensor().items()))


class OARStepLayer(PPOTrainer):
    """Attribution right after verl's old-log-prob pass, the handoff around verl's advantage step."""

    oar_step: OARStep | None = None
    _oar_attribution = None

    def _compute_old_log_prob(self, batch, metrics: dict):
        # docs/method.md §14: where the method can, the workers read its scores from this very forward
        options = None if self.oar_step is None or _bypass(self) else self.oar_step.shared_options(self.global_steps)
        shared = options is not None
        fields = batch.fields
        if shared:
            batch.extra_info[SHARED_KEY] = options
            rows = self.oar_step.teacher_rows(V1IO(self, batch), self.global_steps)
            if rows is not None:  # OAR-G: the rows its noisy passes run on after the pass, beside the batch's rows
                tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                fields=TensorDict({ATTRIBUTE_FIELD: rows.float()}, batch_size=[len(rows)]))
                if fields is not None and ATTRIBUTE_FIELD not in fields:  # the call reads the fields its meta names
                    batch.fields = [*fields, ATTRIBUTE_FIELD]  # (None: every field stored)
        try:
            out = super()._compute_old_log_prob(batch, metrics)
        finally:
            batch.extra_info.pop(SHARED_KEY, None)  # extra_info persists: no later RPC may see it
            batch.fields = fields
        (out.extra_info or {}).pop(SHARED_KEY, None)
        if self.oar_step is not None:
            self._oar_attribution = self.oar_step.attribute(V1IO(self, out, shared), self.global_steps,
                                                            self.timing_raw)
        return out

    def _compute_advantage(self, batch, metrics: dict):
        att, self._oar_attribution = self._oar_attribution, None
        if self.oar_step is None:
            return super()._compute_advantage(batch, metrics)
        if att is None:
            raise RuntimeError("oar: the advantage step came without an old-log-prob pass in this step")
        with self.oar_step.advantage(att, self.global_steps, metrics):
            batch = super()._compute_advantage(batch, metrics)
        return batch


def _bypass(trainer: PPOTrainer) -> bool:
    """verl's rollout-correction bypass mode: no old-log-prob pass runs (the rollout's log-probs stand in)."""
    correction = trainer.config.algorithm.get("rollout_correction", None)
    return bool(correction and correction.get("bypass_mode", False))


class OARTrainerMixin:
    """Start-up and worker set-up of an OAR trainer (first in its bases)."""

    _oar_trainer = True
    verl_mode = "sync"  # the verl trainer mode this OAR trainer extends

    def __init__(self, config):
        self.oar_config = validate_oar_setup(config) if uses_oar(config) else None
        # upstream branches on `trainer_mode` in several places (replay buffer, checkpoint restore, ...): this
        # trainer is verl's mode, plus OAR
        with open_dict(config):
            config.trainer.v1.trainer_mode = self.verl_mode
        super().__init__(config)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()  # verl's mode picks its actor worker (e.g. separate_async's detachable one)
        swap_actor_worker(self.role_worker_mapping)

    _oar_resume: str | None = None  # the checkpoint folder verl resumed from (read once the step exists)

    def on_init_end(self):
        super().on_init_end()
        if self.oar_config is not None:  # the tokenizer exists from here on
            validate_mask_token(self.oar_config, self.config, self.tokenizer)  # before the first rollout
            self.oar_step = OARStep(self.oar_config, self.config.algorithm, self.tokenizer,
                                    self.config.trainer.get("default_local_dir"),
                                    model_window(self.config.actor_rollout_ref.model.get("path")),
                                    multi_turn=multi_turn_enabled(self.config))
            if self._oar_resume is not None:  # mode=auto keeps its decision across a resume
                self.oar_step.load_state(self._oar_resume)

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.oar_step is not None:  # mode=auto: the selector's state beside verl's checkpoint of the step
            self.oar_step.save_state(checkpoint_folder(self.config, self.global_steps))

    def _load_checkpoint(self):
        out = super()._load_checkpoint()  # verl loads before on_init_end: the step reads it there
        if self.oar_config is not None and self.global_steps > 0:
            self._oar_resume = checkpoint_folder(self.config, self.global_steps, load=True)
        return out


@register_trainer(OAR_MODE_PREFIX + "sync")
class OARTrainerSync(OARTrainerMixin, PPOTrainerSync, OARStepLayer):
    """verl's ``sync`` trainer plus OAR (``trainer.v1.trainer_mode=oar_sync``)."""

    verl_mode = "sync"


@register_trainer(OAR_MODE_PREFIX + "colocate_async")
class OARTrainerColocateAsync(OARTrainerMixin, PPOTrainerColocateAsync, OARStepLayer):
    """verl's ``colocate_async`` trainer (partial rollouts, warm-up batches) plus OAR."""

    verl_mode = "colocate_async"


@register_trainer(OAR_MODE_PREFIX + "separate_async")
class OARTrainerSeparateAsync(OARTrainerMixin, PPOTrainerSeparateAsync, OARStepLayer):
    """verl's ``separate_async`` trainer (rollout on its own resources, detachable actor worker) plus OAR."""

    verl_mode = "separate_async"


def oar_trainer_mode(mode: str) -> str:
    """The OAR trainer mode for a ``trainer.v1.trainer_mode`` value (verl's, or already an OAR one).

    Raises:
        ValueError: a mode OAR does not run on, naming the key and the allowed values.
    """
    if mode.startswith(OAR_MODE_PREFIX) and mode[len(OAR_MODE_PREFIX):] in MODES:
        return mode
    if mode in MODES:
        return OAR_MODE_PREFIX + mode
    allowed = ", ".join(MODES + tuple(OAR_MODE_PREFIX + m for m in MODES))
    raise ValueError(f"trainer.v1.trainer_mode={mode!r} has no OAR trainer; choose one of: {allowed}")


