"""OAR on verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``).

``main_ppo`` hard-codes its legacy TaskRunner, so :mod:`oar_verl.main` runs :class:`OARTaskRunner`, which maps the
OAR worker and builds :class:`OARRayPPOTrainer`. It attributes right after the old-log-prob pass, like the V1
trainers. The legacy ``fit`` calls verl's module-level ``compute_advantage`` inline, between two trainer methods, so
the adapter opens the handoff (:meth:`~oar_verl.integration.step.OARStep.advantage`) at the end of
``_compute_old_log_prob`` and closes it at the start of ``_update_actor``; the legacy ``fit`` keeps its metric dicts
local, so ``oar/*`` and ``timing_s/oar`` (with ``timing_s/oar_in_old_log_prob`` and ``timing_s/oar_total``) are
reported with the actor-update metrics. verl's rollout-correction bypass mode skips ``_compute_old_log_prob`` in this
trainer, so it is refused at start-up here (the V1 trainers support it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import torch
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from oar_verl.core.backends.patching import patched_attributes
from oar_verl.integration.guard import uses_oar
from oar_verl.integration.rows import BatchRows, call_seconds
from oar_verl.integration.startup import validate_mask_token, validate_oar_setup
from oar_verl.integration.step import UPDATE_TIMER, OARStep, checkpoint_folder, model_window, multi_turn_enabled
from oar_verl.integration.fields import ATTRIBUTE_FIELD, OUTPUT_FIELDS, SHARED_KEY
from oar_verl.integration.worker import actor_dp_size, swap_actor_worker


class LegacyIO:
    """The step's view of one legacy batch (``DataProto``) and the trainer's actor worker group; with ``shared``, the
    importance fields every row already got from the old-log-prob pass (no RPC)."""

    def __init__(self, trainer: RayPPOTrainer, batch, entropys: torch.Tensor | None = None,
                 shared: dict[str, torch.Tensor] | None = None):
        self.trainer = trainer
        self.batch = batch
        self.entropys = entropys  # (B, T) the old-log-prob pass's entropies (verl drops them from the batch)
        self.shared = shared

    def rows(self, with_responses: bool) -> BatchRows:
        tensors = self.batch.batch
        response_mask = tensors["response_mask"]
        uids = np.asarray(self.batch.non_tensor_batch["uid"], dtype=object)
        eligible = torch.ones(response_mask.shape[0], dtype=torch.bool)  # the legacy trainer adds no padding rows
        # rewards are in the batch before the old-log-prob pass (verl reads them with extract_reward there)
        # every real response token, tool outputs included (response_mask is 0 on them; docs/multi_turn.md)
        valid = tensors["attention_mask"][:, -response_mask.shape[1]:].bool()
        return BatchRows(response_mask, tensors["rm_scores"], uids, eligible,
                         tensors["responses"] if with_responses else None, tensors["attention_mask"].sum(-1).long(),
                         valid)

    def dp_size(self) -> int:
        return actor_dp_size(self.trainer.actor_rollout_wg)

    def compute_importance(self, rows: torch.Tensor, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        if self.shared is not None:
            return {k: v[rows] for k, v in self.shared.items()}
        td = left_right_2_no_padding(self.batch.select_idxs(rows.numpy()).to_tensordict())
        if self.entropys is not None:  # the entropy control of the fidelity metric and of mode=auto
            td["entropys"] = self.entropys[rows]
        tu.assign_non_tensor(td, **options)
        out = self.trainer.actor_rollout_wg.compute_token_importance(td)
        return padded_fields(out)

    def call_seconds(self) -> float:
        return call_seconds(self.shared)  # every row of the old-log-prob call's output


def padded_fields(out) -> dict[str, torch.Tensor]:
    """The importance fields of a worker call's output, padded to (N, T') / (N,)."""
    return {k: (out[k].to_padded_tensor(0.0) if out[k].is_nested else out[k]) for k in OUTPUT_FIELDS}


@contextlib.contextmanager
def log_prob_outputs(trainer: RayPPOTrainer, options: dict[str, Any] | None,
                     rows: torch.Tensor | None = None) -> Iterator[list]:
    """For the duration, verl's ``compute_log_prob`` calls on the actor worker group carry ``options`` (the step's
    :meth:`~oar_verl.integration.step.OARStep.shared_options`, added to the call's non-tensor fields under
    :data:`~oar_verl.integration.fields.SHARED_KEY`) and, given, the (B,) bool ``rows`` to attribute after the pass
    (:meth:`~oar_verl.integration.step.OARStep.teacher_rows`, as :data:`~oar_verl.integration.fields.
    ATTRIBUTE_FIELD`), and their outputs are kept in the yielded list: verl's legacy ``_compute_old_log_prob`` reads
    only its own fields from the output. With ``options`` None, nothing changes."""
    outputs: list = []
    if options is None:
        yield outputs
        return
    group = trainer.actor_rollout_wg
    original = group.compute_log_prob  # verl binds the worker methods on the instance

    def compute_log_prob(data, *args, **kwargs):
        tu.assign_non_tensor(data, **{SHARED_KEY: options})
        if rows is not None:  # the batch's rows, in its order
            data[ATTRIBUTE_FIELD] = rows.float()
        out = original(data, *args, **kwargs)
        outputs.append(out)
        return out

    with patched_attributes(group, compute_log_prob=compute_log_prob):
        yield outputs


class OARRayPPOTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` plus OAR attribution between the old-log-prob pass and the advantage step."""

    _oar_trainer = True

    def __init__(self, config, *args, **kwargs):
        cfg = validate_oar_setup(config) if uses_oar(config) else None
        super().__init__(config, *args, **kwargs)
        if cfg is not None:  # the trainer's own tokenizer, before the first rollout
            validate_mask_token(cfg, config, self.tokenizer)
        self.oar_step = None if cfg is None else OARStep(cfg, config.algorithm, self.tokenizer,
                                                         config.trainer.get("default_local_dir"),
                                                         model_window(config.actor_rollout_ref.model.get("path")),
                                                         multi_turn=multi_turn_enabled(config))
        self._oar_open: contextlib.ExitStack | None = None  # the step opened for the current batch
        self._oar_metrics: dict = {}
        self._oar_timing: dict = {}

    def _compute_old_log_prob(self, batch):
        # docs/method.md §14: where the method can, the workers read its scores from this very forward
        options = None if self.oar_step is None else self.oar_step.shared_options(self.global_steps)
        rows = None if options is None else self.oar_step.teacher_rows(LegacyIO(self, batch), self.global_steps)
        with log_prob_outputs(self, options, rows) as outputs:
            result = super()._compute_old_log_prob(batch)
        if options is not None and len(outputs) != 1:
            raise RuntimeError(f"oar: verl's old-log-prob step made {len(outputs)} compute_log_prob calls, not one")
        shared = padded_fields(outputs[0]) if options is not None else None
        if self.oar_step is not None:
            self._close_oar_step()  # a step left open (no actor update during critic warm-up) reports nothing
            self._oar_metrics, self._oar_timing = {}, {}
            old = result[0] if isinstance(result, tuple) else result  # verl 0.9.1: (old log-probs, mfu)
            entropys = old.batch["entropys"] if "entropys" in old.batch.keys() else None
            att = self.oar_step.attribute(LegacyIO(self, batch, entropys, shared), self.global_steps,
                                         self._oar_timing)
            opened = contextlib.ExitStack()
            opened.enter_context(self.oar_step.advantage(att, self.global_steps, self._oar_metrics))
            self._oar_open = opened
        return result

    def _update_actor(self, batch):
        if self.oar_step is not None:
            self._close_oar_step()
        start = time.perf_counter()
        output = super()._update_actor(batch)
        seconds = time.perf_counter() - start
        if self._oar_metrics:
            # timing_s/oar, oar_in_old_log_prob, oar_total, and oar_fidelity on a step that measured fidelity
            output.meta_info["metrics"].update({**self._oar_metrics,
                                                **{f"timing_s/{k}": v for k, v in self._oar_timing.items()}})
            self._oar_metrics = {}
        self._oar_timing[UPDATE_TIMER] = seconds  # mode=auto's cost unit, read at the next step (not re-logged)
        return output

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.oar_step is not None:  # mode=auto: the selector's state beside verl's checkpoint of the step
            self.oar_step.save_state(checkpoint_folder(self.config, self.global_steps))

    def _load_checkpoint(self):
        out = super()._load_checkpoint()
        if self.oar_step is not None and self.global_steps > 0:
            self.oar_step.load_state(checkpoint_folder(self.config, self.global_steps, load=True))
        return out

    def _close_oar_step(self) -> None:
        opened, self._oar_open = self._oar_open, None
        if opened is not None:
            opened.close()


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
