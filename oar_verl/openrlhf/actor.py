"""The OAR policy actor for OpenRLHF 0.11: :class:`PolicyModelActor` whose ``fit`` reshapes the replay buffer first.

OpenRLHF's trainer calls ``fit`` on every actor rank together, right before ``ppo_train``; the replay buffer then
holds this rank's unpadded per-sample items with their outcome advantages. The OAR actor attributes them on its own
DeepSpeed-wrapped module (:func:`oar_verl.openrlhf.reshape.reshape_replay_buffer`), then runs OpenRLHF's ``fit``
unchanged and adds the ``oar/*`` metrics to the status it returns (OpenRLHF logs that status as is). ``fisher`` and
``conservative`` read their scores from the experience maker's forward of the same weights instead
(``forward``, :mod:`oar_verl.openrlhf.shared`); that time is ``timing/oar_in_experience_maker``, beside ``fit``'s
``timing/oar``, and both are ``timing/oar_total``.
"""

from __future__ import annotations

import dataclasses
import time

import ray
from openrlhf.trainer.ray.launcher import RayActorGroup
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from oar_verl.core.checks.sliding_window import sliding_window
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.step import due as fidelity_due
from oar_verl.core.methods.attribution import shared_mode
from oar_verl.core.reshaping.metrics import flat_warning
from oar_verl.openrlhf.auto import STATE_KEY, AutoStep
from oar_verl.openrlhf.entropy import policy_entropies
from oar_verl.openrlhf.reshape import reshape_replay_buffer
from oar_verl.openrlhf.shared import SharedRows, attributed_forward, batch_items

FLAG_PREFIX = "--oar"  # OAR options on the command line: --oar.<key>=<value>
TIMER = "timing/oar"  # fit's attribution, this rank's seconds
# the slowest rank's attribution seconds inside the experience maker's forwards of the step (--oar.shared_forward:
# SharedRows.seconds; 0.0 where fit attributed), and both: OAR's cost
IN_FORWARD_TIMER = "timing/oar_in_experience_maker"
TOTAL_TIMER = "timing/oar_total"
ARGS_KEY = "oar"  # the validated OAR settings ride on OpenRLHF's args namespace (pickled to every actor)


def token_budget(args) -> int | None:
    """One attribution pass's token budget from OpenRLHF's own settings: ``--train.max_tokens_per_gpu`` with dynamic
    batching (what one training micro-batch holds), else None (the micro-batch size x the longest sequence is taken
    then, see :func:`micro_batch_rows`)."""
    return int(args.train.max_tokens_per_gpu) if args.train.dynamic_batch_enable else None


def micro_batch_rows(args) -> int:
    """Rows of one training micro-batch (``--train.micro_batch_size``)."""
    return int(args.train.micro_batch_size)


def resumed_step(checkpoint_states: dict | None) -> int:
    """The global step OpenRLHF saved with the checkpoint this actor loaded (``--ckpt.load_enable``), 0 without one.

    OpenRLHF does not pass its step to ``fit``; the actor counts its ``fit`` calls from here, so that after a resume
    the probe schedule and the OAR-G noise seeds continue where the saved run stopped."""
    return int((checkpoint_states or {}).get("global_step", 0) or 0)


class OARPolicyModelActorImpl(PolicyModelActor.__ray_actor_class__):
    """OpenRLHF's policy actor with OAR applied to the replay buffer at the top of ``fit``."""

    _oar_step = 0
    _oar_auto: AutoStep | None = None  # --oar.mode auto: this rank's copy of the one decision (oar_verl.openrlhf.auto)
    _oar_shared: SharedRows | None = None  # the scores read from the experience maker's forwards for the next fit
    _oar_flat_warned = False  # flat_warning is logged once a run

    def _oar_config(self) -> OARConfig:
        return OARConfig.from_mapping(getattr(self.strategy.args, ARGS_KEY), prefix=FLAG_PREFIX)

    def _oar_model(self):
        """The policy's causal LM (the DeepSpeed engine's module)."""
        return self.actor.model.module if hasattr(self.actor.model, "module") else self.actor.model

    def _oar_next_step(self) -> int:
        """The step the next ``fit`` attributes at (resumed: the checkpoint's step + 1)."""
        return (self._oar_step or resumed_step(getattr(self, "checkpoint_states", None))) + 1

    def _oar_shared_mode(self, cfg: OARConfig, step: int) -> str | None:
        """The mode whose scores ``step`` reads from the experience maker's forward (docs/method.md §14), or None: not
        on a step that measures fidelity or calibrates ``mode=auto`` (their passes run in ``fit``), nor where
        :func:`~oar_verl.core.methods.attribution.shared_mode` says none can. The same on every rank."""
        if fidelity_due(cfg, step):
            return None
        steady = self._auto(cfg, self._oar_model()).selector.steady_mode(step) if AutoStep.wanted(cfg) else None
        return shared_mode(cfg, steady, teacher=False)  # its scores only: fit runs OAR-G's passes on its own rows

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        """OpenRLHF's action log-probs for the experience maker; where the next step's method can, its scores are
        read from the same forward (:mod:`oar_verl.openrlhf.shared`) and kept for ``fit``."""
        kwargs = dict(action_mask=action_mask, attention_mask=attention_mask, packed_seq_lens=packed_seq_lens,
                      mm_train_inputs_list=mm_train_inputs_list)
        cfg, step = self._oar_config(), self._oar_next_step()
        mode = None if action_mask is None or attention_mask is None else self._oar_shared_mode(cfg, step)
        if mode is None:
            return super().forward(sequences, **kwargs)
        model = self._oar_model()
        if self._oar_shared is None or (self._oar_shared.step, self._oar_shared.mode) != (step, mode):
            self._oar_shared = SharedRows(step, mode)
        items = batch_items(sequences, action_mask, attention_mask)
        args = self.strategy.args
        # the backward recomputes as the actor's update does, and always when this forward holds more tokens than one
        # training micro-batch (the experience maker's micro-batches may be larger): never above the update's memory
        train_tokens = token_budget(args) or micro_batch_rows(args) * sequences.shape[1]
        checkpointing = bool(args.actor.gradient_checkpointing_enable) or int(attention_mask.sum()) > train_tokens
        with attributed_forward(model, self.tokenizer, dataclasses.replace(cfg, mode=mode), step, items,
                                attention_mask, packed=bool(getattr(self.actor, "packing_samples", False)),
                                checkpointing=checkpointing, device=next(model.parameters()).device) as rows:
            out = super().forward(sequences, **kwargs)
        self._oar_shared.rows.update(rows.rows)
        self._oar_shared.seconds += rows.seconds  # attribution's own work inside this forward
        return out

    def _oar_take_shared(self, cfg: OARConfig) -> SharedRows | None:
        """Every rank's scores read for this step's ``fit`` (every rank calls it together), or None when the step
        runs its own passes."""
        mode = self._oar_shared_mode(cfg, self._oar_step)
        mine, self._oar_shared = self._oar_shared, None
        if mode is None:
            return None
        if mine is None or (mine.step, mine.mode) != (self._oar_step, mode):
            mine = SharedRows(self._oar_step, mode)  # none read for this step here: the others' may be
        return mine.gathered()

    def fit(self, kl_ctl: float = 0):
        args = self.strategy.args
        cfg = self._oar_config()
        if self._oar_step == 0:  # resumed: continue from the checkpoint's step (probe schedule, OAR-G noise seeds)
            self._oar_step = resumed_step(getattr(self, "checkpoint_states", None))
        self._oar_step += 1
        t0 = time.time()
        items = self.trainer.replay_buffer.items
        model = self._oar_model()
        shared = self._oar_take_shared(cfg)
        longest = max((int(it.sequences.numel()) for it in items), default=0)
        budget = token_budget(args) or micro_batch_rows(args) * max(longest, 1)
        checkpointing = bool(args.actor.gradient_checkpointing_enable)
        plan, auto = None, None
        if AutoStep.wanted(cfg):  # every rank decides alike from every rank's rows (docs/auto.md)
            auto = self._auto(cfg, model)
            plan = auto.plan(items, self._oar_step)
        device = next(model.parameters()).device
        measures = (auto is not None and auto.calibrating) or fidelity_due(cfg, self._oar_step)
        entropies = policy_entropies(self.actor, items, device) if measures else None  # the entropy control
        if auto is not None:
            for line in auto.measure(items, model, self.tokenizer, self._oar_step, max_tokens=budget,
                                     checkpointing=checkpointing, device=device, entropies=entropies):
                if self.strategy.is_rank_0():
                    print(line, flush=True)
        metrics = reshape_replay_buffer(items, model, self.tokenizer, cfg, self._oar_step, max_tokens=budget,
                                        checkpointing=checkpointing, device=device, plan=plan,
                                        entropies=entropies, shared=shared).metrics
        warning = None if self._oar_flat_warned else flat_warning(metrics, self._oar_step)
        if warning:  # every rank alike (reduced metrics); printed by rank 0
            self._oar_flat_warned = True
            if self.strategy.is_rank_0():
                print(warning, flush=True)
        oar_time = time.time() - t0
        tokens = sum(int(it.sequences.numel()) for it in items)  # before fit: it clears the replay buffer
        t1 = time.time()
        status = super().fit(kl_ctl)
        if auto is not None:
            auto.note_update(time.time() - t1, tokens)
            metrics.update(auto.metrics(self._oar_step))
        status.update(metrics)
        # OAR's cost: fit's attribution, and what the experience maker's forwards read (the slowest rank's)
        in_forward = shared.seconds if shared is not None else 0.0
        status[TIMER], status[IN_FORWARD_TIMER], status[TOTAL_TIMER] = oar_time, in_forward, oar_time + in_forward
        return status

    def _auto(self, cfg: OARConfig, model) -> AutoStep:
        """This rank's ``mode=auto`` state: built at the first ``fit`` (the policy's sliding window bands the rows),
        resumed from the loaded checkpoint's ``client_states`` when it has one."""
        if self._oar_auto is None:
            config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
            self._oar_auto = AutoStep(cfg, sliding_window(config))
            state = (getattr(self, "checkpoint_states", None) or {}).get(STATE_KEY)
            if state:
                line = self._oar_auto.load_state_dict(state)
                if self.strategy.is_rank_0():
                    print(line, flush=True)
        return self._oar_auto

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """OpenRLHF's checkpoint, with ``mode=auto``'s selector state in its ``client_states`` (a resumed run keeps
        its decision)."""
        if self._oar_auto is not None:
            client_states = {**(client_states or {}), STATE_KEY: self._oar_auto.state_dict()}
        return super().save_checkpoint(tag, client_states, metric_value=metric_value, metric_key=metric_key)


OARPolicyModelActor = ray.remote(num_gpus=1)(OARPolicyModelActorImpl)


class NotOARActorError(RuntimeError):
    """OpenRLHF built or runs its policy actor group with a class that is not OAR's."""


def _is_oar_instance(actor) -> bool:  # runs inside each policy actor (ray's __ray_call__)
    return isinstance(actor, OARPolicyModelActorImpl)


def check_group_runs_oar(handles: list) -> None:
    """At the policy group's first ``fit``: ask every actor, in its own process, whether it is OAR's actor."""
    import ray

    found = ray.get([h.__ray_call__.remote(_is_oar_instance) for h in handles])
    if not all(found):
        raise NotOARActorError(f"the first fit of the policy actor group: {found.count(False)} of {len(found)} actors "
                               "are not OAR's actor, so OAR would not run. Refusing.")
    print(f"[oar] first fit: all {len(found)} policy actors are OAR's", flush=True)


class OARPolicyGroup(RayActorGroup):
    """OpenRLHF's actor group of OAR's policy actors (:func:`oar_verl.openrlhf.checks.guard_actor_groups` gives the
    group this class): at its first ``fit`` every actor is asked whether it runs OAR's ``fit``."""

    _oar_checked = False

    def async_run_method(self, method_name, *args, **kwargs):
        if method_name == "fit" and not self._oar_checked:
            check_group_runs_oar(self._actor_handlers)
            self._oar_checked = True
        return super().async_run_method(method_name, *args, **kwargs)

