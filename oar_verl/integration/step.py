"""One OAR training step, top to bottom, for every trainer.

Right after verl's old-log-prob pass, with the weights that computed the old log-probs, ``OARStep.attribute`` runs
steps 1-5 (``timing_s/oar``): (1) rows, (2) the base advantage, once, (3) selection (``rows.select_rows``), (4) the
workers' ``compute_token_importance`` RPC, (5) assembly into batch tensors (``rows.assemble``). Where the method reads
from verl's pass (``shared_options``) step 4 reads what the workers attributed inside it instead, timed there
(``timing_s/oar_in_old_log_prob``); ``timing_s/oar_total`` is both. ``OARStep.advantage``
is a context manager around verl's own advantage step: it opens the handoff (6: the ``oar`` estimator reshapes the
base advantage), then reports ``oar/*``, the fidelity and the token dump when due (7). The trainers only adapt verl's
batch to :class:`TrainerIO`. Details: docs/verl.md, "One step" and "Why a handoff". With ``mode=auto`` the step's
selector resolves each band's mode and, on calibration steps, takes every rank's candidate scores (docs/auto.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from verl.utils.profiler import marked_timer

from oar_verl.core.auto import AutoSelector, AutoSettings, Evidence, bands_of
from oar_verl.core.checks.sliding_window import sliding_window
from oar_verl.core.checks.startup import require_resolved
from oar_verl.core.config import AUTO_MODE, OARConfig
from oar_verl.core.fidelity.step import due as fidelity_due
from oar_verl.core.fidelity.step import step_metrics
from oar_verl.core.methods.attribution import METHODS, shared_mode
from oar_verl.core.reshaping.reshape import attribution_rows
from oar_verl.core.reshaping.metrics import flat_warning
from oar_verl.core.text.spans import locate_answer_spans
from oar_verl.core.text.turns import turn_layout, turn_shares
from oar_verl.integration import dumps, handoff
from oar_verl.integration.estimator import base_advantage
from oar_verl.integration.fields import AUTO_CONTROLS, AUTO_KEY, CONFIG_KEY, STEP_KEY
from oar_verl.integration.rows import BatchRows, StepAttribution, assemble, merge_outputs, select_rows, take

TIMER = "oar"  # -> timing_s/oar: the step's own part (steps 1-5), inside verl's timing_s/old_log_prob
# -> timing_s/oar_in_old_log_prob: the slowest rank's attribution work inside verl's compute_log_prob call, where the
# method reads from that pass (fields.SECONDS_FIELD; 0.0 where the step's own RPC attributed: TIMER holds that)
IN_CALL_TIMER = "oar_in_old_log_prob"
TOTAL_TIMER = "oar_total"  # -> timing_s/oar_total = timing_s/oar + timing_s/oar_in_old_log_prob: OAR's cost
# -> timing_s/oar_fidelity: the slowest rank's fidelity measurement (within oar_total's: oar's where the step's RPC
# measured, oar_in_old_log_prob's where the old-log-prob call did)
FIDELITY_TIMER = "oar_fidelity"
UPDATE_TIMER = "update_actor"  # verl's timing_raw key of the actor update (timing_s/update_actor)
AUTO_STATE_FILE = "oar_auto.json"  # the mode=auto selector's state, beside verl's checkpoint of a step

logger = logging.getLogger("oar_verl")


def model_window(model_path: str | None) -> int | None:
    """The sliding window of a local model directory's ``config.json`` (None: none, or not a readable local
    directory: ``mode=auto`` then decides for one band ``all``)."""
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return sliding_window(config) if isinstance(config, dict) else None


def checkpoint_folder(trainer_config, global_step: int, load: bool = False) -> str:
    """verl's checkpoint folder of a step (``trainer.default_local_dir/global_step_N``, made absolute as verl does
    when loading; ``trainer.resume_from_path`` when loading with ``resume_mode=resume_path``)."""
    trainer = trainer_config.trainer
    if load and trainer.get("resume_mode", "auto") == "resume_path" and trainer.get("resume_from_path"):
        return os.path.abspath(str(trainer.resume_from_path))
    return os.path.abspath(os.path.join(str(trainer.default_local_dir), f"global_step_{global_step}"))


def multi_turn_enabled(trainer_config) -> bool:
    """Whether the run's rollouts go through verl's multi-turn agent loop
    (``actor_rollout_ref.rollout.multi_turn.enable``): its steps log ``oar/turns/*`` every step, 0 where no tool ran."""
    try:
        return bool(trainer_config.actor_rollout_ref.rollout.multi_turn.get("enable", False))
    except AttributeError:
        return False


class TrainerIO(Protocol):
    """What a trainer adapter gives the step: its batch, its actor's data-parallel size and the worker RPC."""

    def rows(self, with_responses: bool) -> BatchRows:
        """The batch's rows (responses only when ``with_responses``: the step asks for them every step, for the
        token dump and ``oar/rewarded_without_span_frac``)."""

    def dp_size(self) -> int:
        """The actor's data-parallel size."""

    def compute_importance(self, rows: torch.Tensor, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Run the workers' ``compute_token_importance`` on ``rows`` (N,) with these per-call options; return its
        outputs padded to (N, T') / (N,)."""

    def call_seconds(self) -> float:
        """The slowest rank's attribution seconds inside this step's old-log-prob call (:func:`~oar_verl.integration.
        rows.call_seconds` over every row that call returned), 0.0 where it carried no attribution."""


def turn_metrics(batch: BatchRows, result, answer: torch.Tensor | None = None,
                 multi_turn: bool = False) -> dict[str, float]:
    """``oar/turns/*`` of a batch of a multi-turn run (verl's agent loop: tool outputs inside the responses are
    context; docs/multi_turn.md): every key on every step of a run with ``multi_turn`` (0 where no tool ran; the two
    shares NaN where no reshaped row has two turns), and on any batch holding context; {} for a single-turn batch of a
    single-turn run.

    Keys: ``per_row`` assistant turns and ``tool_rounds_per_row`` rounds of tool outputs (one context run each, as
    verl's ``num_turns`` counts a round of parallel calls as one turn) over the real rows; ``share_first`` /
    ``share_last`` the first and the final turn's share of the reshaped credit Σw against GRPO's share
    (``*_uniform``: the turn's reasoning tokens / R) over the reshaped rows with at least two turns
    (``multi_turn_rows``); ``answer_in_earlier_turn_frac`` (with ``answer``) the rows with a span whose answer lies
    before their final turn; and the layout's invariants, 0 when they hold: ``context_adv_max_abs_diff`` (the largest
    |Â − A| on a context token: their advantage is the base estimator's, bit for bit), ``context_reshaped_tokens``
    (context tokens the gate weighted) and ``answer_context_tokens`` (answer-span tokens on context).

    Args:
        batch: the step's rows. result: the estimator's Reshaped. answer: (B, T) bool the step's answer-span tokens.
        multi_turn: the run is multi-turn (:func:`multi_turn_enabled`).
    """
    if batch.valid is None:
        return {}
    valid = batch.valid.bool()[:, :batch.response_mask.shape[1]]
    layout = turn_layout(valid, batch.response_mask)
    if not multi_turn and not bool(layout.context.any()):
        return {}
    real = batch.eligible.bool()
    n = max(int(real.sum()), 1)
    tw = result.token_weights
    context = layout.context.to(tw.weights.device)
    diff = (result.advantages.double() - result.base_advantages.double()).abs()
    out = {"oar/turns/per_row": float(layout.turns[real].sum()) / n,
           "oar/turns/tool_rounds_per_row": float(layout.context_runs[real].sum()) / n,
           "oar/turns/context_adv_max_abs_diff": float(torch.where(context, diff, 0.0).max()) if diff.numel() else 0.0,
           "oar/turns/context_reshaped_tokens": float((tw.reshaped & context).sum())}
    if answer is not None:
        answer = answer.bool()[:, :valid.shape[1]].cpu()
        spans = answer.any(-1)
        last_turn = torch.where(answer, layout.turn, -1).amax(-1) if answer.numel() else layout.turns - 1
        earlier = spans & (last_turn < layout.turns - 1)
        out["oar/turns/answer_in_earlier_turn_frac"] = float(earlier.sum()) / max(int(spans.sum()), 1)
        out["oar/turns/answer_context_tokens"] = float((answer & layout.context).sum())
    shares = turn_shares(tw.weights, tw.reshaped, layout, tw.reshaped.any(-1) & real)
    out.update({f"oar/turns/share_{k}": float(v) for k, v in shares.items() if k != "rows"})
    out["oar/turns/multi_turn_rows"] = float(shares["rows"])
    return out


def rewarded_without_span(paid: torch.Tensor, has_span: torch.Tensor) -> float:
    """``oar/rewarded_without_span_frac``: of the rows the reward graded above 0, the share with no answer span in the
    model's own tokens (their credit is GRPO's w = 1 where attributed; a reward that pays for words the model did not
    write, e.g. a tool's output, shows here); 0.0 where no row was paid.

    Args:
        paid: (B,) bool the rows graded above 0 (real rows only). has_span: (B,) bool a span among the model's tokens.
    """
    paid = paid.bool()
    return float((paid & ~has_span.bool()).sum()) / max(int(paid.sum()), 1)


def paid_rows_spans(batch: BatchRows, att, tokenizer, patterns) -> tuple[torch.Tensor, torch.Tensor]:
    """((B,) bool the real rows the reward graded above 0, (B,) bool whether each has an answer span among the
    model's own tokens): the attributed rows' spans as the workers found them, the others' (a group paid alike has a
    zero advantage and is not attributed) located here with the core's rule on the batch's responses."""
    paid = (batch.scores.sum(-1) > 0) & batch.eligible.bool()
    B = paid.shape[0]
    known = torch.zeros(B, dtype=torch.bool)
    has = torch.zeros(B, dtype=torch.bool)
    known[att.rows] = True
    has[att.rows] = att.found[att.rows].bool()
    rest = (paid & ~known).nonzero().flatten()
    if len(rest) and batch.responses is not None and tokenizer is not None:
        width = batch.response_mask.shape[1]
        valid = (batch.valid if batch.valid is not None else batch.response_mask)[:, :width]
        spans = locate_answer_spans(batch.responses[rest, :width], valid[rest], tokenizer, patterns,
                                    model_mask=batch.response_mask[rest])
        has[rest] = spans.found.cpu()
        known[rest] = True
    return paid & known, has


def session_grpo(batch: BatchRows, algorithm: Any, cfg: OARConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's (advantages, returns), (B, T) each, over sessions with several outputs as verl V1 computes it
    (``compute_advantage_for_multi_trajectories``): the group statistics over each session's final output only, and
    each session's sequence advantage copied to its other outputs (on their ``response_mask``)."""
    final = batch.session_final
    finals, local = final.unique(return_inverse=True)  # the final rows, and each row's position among them
    adv, _ = base_advantage(batch.scores[finals], batch.response_mask[finals], batch.uids[finals.numpy()], algorithm,
                            cfg)
    first = batch.response_mask[finals].argmax(-1)  # verl reads each final output's first response token
    seq = adv[torch.arange(len(finals)), first]
    out = seq[local][:, None] * batch.response_mask
    return out, out


class OARStep:
    """The OAR part of every training step of one run.

    Args:
        cfg: the validated OAR configuration.
        algorithm: verl's ``algorithm`` config (base estimator settings, KL-in-reward).
        tokenizer: the policy's tokenizer (token dumps).
        default_local_dir: ``trainer.default_local_dir`` (where dumps go unless ``algorithm.oar.dump_dir``).
        window: the policy's sliding window (:func:`model_window`; ``mode=auto`` decides inside and past it).
        multi_turn: the run's rollouts go through verl's multi-turn agent loop (:func:`multi_turn_enabled`).
    """

    def __init__(self, cfg: OARConfig, algorithm: Any, tokenizer, default_local_dir: str | None,
                 window: int | None = None, multi_turn: bool = False):
        self.cfg = cfg
        self.multi_turn = multi_turn
        self.algorithm = algorithm
        self.tokenizer = tokenizer
        self.default_local_dir = default_local_dir
        # mode=auto: the one decision, on the driver (docs/auto.md); every rank gets it through worker_options
        self.selector = AutoSelector(AutoSettings.from_config(cfg, window)) if cfg.mode == AUTO_MODE else None
        self._prompt_ids: dict[Any, int] = {}  # prompt uid -> bootstrap cluster id
        self._last_update: tuple[dict, float] | None = None  # (the previous step's timing_raw, its tokens per rank)
        self._update_spt = float("nan")  # the actor update's seconds per token per rank (the previous step's)
        self._calibrating = False  # whether the last attributed step was a calibration step
        self._flat_warned = False  # flat_warning is logged once a run
        self._dumps = dumps.DumpSchedule(cfg.dump_every, "algorithm.oar.dump_every", why=(
            "every prompt group's rewards tied" + (", or mode=auto's plain-GRPO fallback" if self.selector else "")))

    def attribute(self, io: TrainerIO, global_step: int, timing_raw: dict) -> StepAttribution:
        """Steps 1-5, timed as ``timing_s/oar``: rows → base advantage → selection → worker RPC → assembly; the
        workers' attribution inside verl's old-log-prob call as ``timing_s/oar_in_old_log_prob`` (0 where none ran
        there), both as ``timing_s/oar_total`` (each accumulated like verl's timers: several ``_step_once`` calls of
        one step add up)."""
        with marked_timer(TIMER, timing_raw, color="purple"):
            batch = io.rows(with_responses=True)  # the dump's tokens, and the spans of paid rows not attributed
            base = self.base_advantage(batch)
            if self.selector is not None:
                att = self.attribute_auto(io, batch, base, global_step, timing_raw)
            else:
                rows = select_rows(self.wanted(batch, base), batch.eligible, io.dp_size())
                out = io.compute_importance(rows, self.worker_options(global_step)) if len(rows) else None
                att = assemble(out, rows, batch, base)
            in_call = io.call_seconds()  # every row's, not the selected rows' only: every rank's work in the pass
        timing_raw[IN_CALL_TIMER] = timing_raw.get(IN_CALL_TIMER, 0.0) + in_call
        timing_raw[TOTAL_TIMER] = timing_raw[TIMER] + timing_raw[IN_CALL_TIMER]
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
        several = batch.session_final is not None and bool(
            (batch.session_final != torch.arange(len(batch.session_final))).any())
        if self.algorithm.get("use_kl_in_reward", False):
            if several and self.cfg.base_estimator == "grpo":
                raise RuntimeError(
                    "oar: sessions with several outputs (a custom agent loop) and algorithm.use_kl_in_reward=True: "
                    "verl's GRPO takes each session's final output after the KL penalty, which OAR's step cannot see. "
                    "Allowed: algorithm.use_kl_in_reward=False (a KL loss: actor_rollout_ref.actor.use_kl_loss=True), "
                    "or one output per session")
            return None
        if several and self.cfg.base_estimator == "grpo":
            return session_grpo(batch, self.algorithm, self.cfg)
        return base_advantage(batch.scores, batch.response_mask, batch.uids, self.algorithm, self.cfg)

    def wanted(self, batch: BatchRows, base: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """(B,) rows whose importance is needed: every row unless zero-advantage rows are skipped and the base
        advantage is known (with a KL penalty in the reward every row has a non-zero advantage)."""
        if base is None:
            return batch.eligible.clone()
        return attribution_rows(base[0], batch.response_mask, self.cfg, batch.eligible)

    def shared_mode(self, global_step: int) -> str | None:
        """The mode whose scores this step reads from verl's old-log-prob forward (``algorithm.oar.shared_forward``;
        docs/method.md §14), or None: a method that can share; under ``mode=auto`` only on a step that does not
        calibrate (a calibration step scores every candidate) and where every band runs the same such mode (one pass
        holds every row). A fidelity step measures right after the pass, in the same call."""
        steady = None if self.selector is None else self.selector.steady_mode(global_step)
        return shared_mode(self.cfg, steady)

    def teacher_rows(self, io: TrainerIO, global_step: int) -> torch.Tensor | None:
        """(B,) bool the rows this step will read, when its shared mode reads only its clean teachers from the
        old-log-prob forward (OAR-G, ``Method.shared_teacher``): the worker runs the method's noisy passes on these
        rows alone (:data:`~oar_verl.integration.fields.ATTRIBUTE_FIELD`), so zero-advantage rows cost nothing, as
        in the step's own call; None for every other mode (a method read from the forward scores every row of it)."""
        mode = self.shared_mode(global_step)
        if mode is None or not METHODS.get(mode).shared_teacher:
            return None
        batch = io.rows(with_responses=False)
        return self.wanted(batch, self.base_advantage(batch)).cpu()

    def shared_options(self, global_step: int) -> dict[str, Any] | None:
        """The options that ask verl's ``compute_log_prob`` call for the step's scores (:meth:`shared_mode`; the
        trainers add them to the call under :data:`~oar_verl.integration.fields.SHARED_KEY`), or None."""
        mode = self.shared_mode(global_step)
        return None if mode is None else self.worker_options(global_step, mode)

    def worker_options(self, global_step: int, mode: str | None = None,
                       auto: dict[str, Any] | None = None) -> dict[str, Any]:
        """Per-call options of the worker RPC (verl fixes the workers' init arguments): the configuration with
        ``mode`` (``mode=auto`` resolved: a worker never receives ``auto``), the step and, on a calibration step,
        ``oar_auto`` = {"candidates": [...]}."""
        cfg = require_resolved(self.cfg if mode is None else dataclasses.replace(self.cfg, mode=mode))
        return {CONFIG_KEY: cfg.to_dict(), STEP_KEY: int(global_step), **({AUTO_KEY: auto} if auto else {})}

    # -- mode=auto (docs/auto.md) ---------------------------------------------------------------------------------
    def attribute_auto(self, io: TrainerIO, batch: BatchRows, base, global_step: int,
                       timing_raw: dict) -> StepAttribution:
        """Steps 3-5 with ``mode=auto``: one RPC per distinct mode among the bands (each band's rows with the
        selector's mode; rows of a band on the plain-GRPO fallback attributed only on a calibration step, with
        ``auto_default``, for the evidence, and left unreshaped); on a calibration step the workers also score every
        candidate and the selector takes the rows (every rank's: one decision)."""
        sel, dp = self.selector, io.dp_size()
        self._note_update(timing_raw, batch, dp)
        B = batch.response_mask.shape[0]
        window = sel.settings.window
        if window is not None and batch.lengths is None:
            raise RuntimeError("oar: mode=auto on a sliding-window model needs the rows' lengths from the trainer")
        bands = bands_of(batch.lengths if window is not None else torch.zeros(B, dtype=torch.long), window)
        calibrating, wanted = sel.calibrating(global_step), self.wanted(batch, base)
        groups, plain = sel.plan(bands, global_step)
        groups = {mode: rows & wanted for mode, rows in groups.items()}
        auto = {"candidates": list(sel.settings.candidates)} if calibrating else None
        calls, parts, done = [], [], torch.zeros(B, dtype=torch.bool)
        self._calibrating = calibrating
        for mode, mask in groups.items():
            rows = select_rows(mask, batch.eligible, dp)
            if not len(rows):
                continue
            out = io.compute_importance(rows, self.worker_options(global_step, mode, auto))
            calls.append((rows, out))
            keep = []  # each wanted row's first result; no top-up row (it may belong to another mode's call)
            for i, r in enumerate(rows.tolist()):  # per row, not per token
                if mask[r] and not done[r]:
                    done[r] = True
                    keep.append(i)
            parts.append(take(rows, out, torch.tensor(keep, dtype=torch.long)))
        rows, out = merge_outputs(parts)
        att = assemble(out, rows, batch, base)
        if bool(plain.any()):  # the fallback: these rows keep the base advantage (w = 1)
            inputs = att.estimator_inputs
            att = dataclasses.replace(att, estimator_inputs=dataclasses.replace(
                inputs, attributed=inputs.attributed & ~plain))
        if calibrating:
            evidence, costs = self.auto_evidence(calls, batch, bands)
            for line in sel.observe(global_step, evidence, costs):
                print(line, flush=True)
                logger.warning(line)
        return att

    def auto_evidence(self, calls, batch: BatchRows, bands: tuple[str, ...]) -> tuple[Evidence, dict[str, float]]:
        """The selector's rows from the calls' ``oar_auto_*`` fields (each batch row once, where measured; its prompt
        uid's cluster id; its band) and each candidate's cost: the slowest rank's seconds per token over the actor
        update's (the previous step's ``timing_s/update_actor`` per token per rank; NaN before the first update)."""
        cands = self.selector.settings.candidates
        rows, out = merge_outputs(calls)
        if out is None or "oar_auto_aopc_c0" not in out:
            return Evidence.concat([]), {}
        aopc = {c: out[f"oar_auto_aopc_c{i}"].double() for i, c in enumerate(cands)}
        # a control measured on no row (entropy without old-log-prob entropies) is left out, not required
        aopc.update({k: out[f"oar_auto_aopc_{k}"].double() for k in AUTO_CONTROLS
                     if not bool(out[f"oar_auto_aopc_{k}"].isnan().all())})
        measured = (~aopc[cands[0]].isnan()).tolist()
        seen, keep = set(), []
        for i, r in enumerate(rows.tolist()):  # per row, not per token: each batch row once
            if measured[i] and r not in seen:
                seen.add(r)
                keep.append(i)
        keep = torch.tensor(keep, dtype=torch.long)
        picked = rows[keep].tolist()
        groups = torch.tensor([self._prompt_ids.setdefault(batch.uids[r], len(self._prompt_ids)) for r in picked],
                              dtype=torch.long)
        evidence = Evidence({k: v[keep] for k, v in aopc.items()}, out["oar_auto_static"].double()[keep], groups,
                            tuple(bands[r] for r in picked))
        costs = {}
        for i, c in enumerate(cands):
            spt = out[f"oar_auto_spt_c{i}"].double()
            slowest = float(spt.nan_to_num(-1.0).max()) if len(spt) else -1.0
            costs[c] = slowest / self._update_spt if slowest >= 0 and self._update_spt > 0 else float("nan")
        return evidence, costs

    def _note_update(self, timing_raw: dict, batch: BatchRows, dp: int) -> None:
        """Read the previous step's actor-update seconds (verl fills ``timing_raw["update_actor"]`` after this call,
        in the dict the step was given) per token per rank; remember this step's dict and tokens."""
        if self._last_update is not None:
            timing, tokens = self._last_update
            seconds = timing.get(UPDATE_TIMER)
            if seconds is not None and tokens > 0 and math.isfinite(float(seconds)):
                self._update_spt = float(seconds) / tokens
        tokens = float(batch.lengths[batch.eligible].sum()) / max(dp, 1) if batch.lengths is not None else 0.0
        self._last_update = (timing_raw, tokens)

    def save_state(self, folder: str) -> str | None:
        """Write the ``mode=auto`` selector's state as ``oar_auto.json`` in ``folder`` (verl's checkpoint of the
        step); the path, or None without ``mode=auto``."""
        if self.selector is None:
            return None
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, AUTO_STATE_FILE)
        with open(path, "w") as f:
            json.dump(self.selector.state_dict(), f, allow_nan=False)
        return path

    def load_state(self, folder: str) -> bool:
        """Resume the selector from ``folder``'s ``oar_auto.json``; False when there is none (a checkpoint written
        without ``mode=auto``: the run calibrates again) or without ``mode=auto``."""
        path = os.path.join(folder, AUTO_STATE_FILE)
        if self.selector is None or not os.path.exists(path):
            return False
        with open(path) as f:
            self.selector.load_state_dict(json.load(f))
        print(f"oar auto: resumed from {path}: {self.selector.summary()}", flush=True)
        return True

    def report(self, att: StepAttribution, result, global_step: int) -> dict[str, float]:
        """Step 7: ``oar/*`` metrics from the estimator's result, and the token dump when one is due."""
        if result is None:
            raise RuntimeError("oar: the advantage step did not run the `oar` estimator (algorithm.adv_estimator was "
                               "changed after start-up?)")
        response_mask = att.estimator_inputs.response_mask
        metrics = result.metrics(span_found=att.found[att.rows], answer_probe=att.answer_probe[att.rows])
        metrics["oar/attributed_seq_frac"] = len(att.rows.unique()) / max(int(response_mask.shape[0]), 1)
        metrics["oar/global_step"] = float(global_step)  # the step the probe schedule and the noise seeds used
        warning = None if self._flat_warned else flat_warning(metrics, global_step)
        if warning:
            self._flat_warned = True
            print(warning, flush=True)
            logger.warning(warning)
        if len(att.passes) and bool((att.passes >= 0).all()):  # passes per data-parallel rank (the slowest sets it)
            metrics["oar/passes_max"], metrics["oar/passes_min"] = float(att.passes.max()), float(att.passes.min())
        counted = att.copies >= 0  # OAR-P rows whose masked copies were counted (docs/scaling.md: the cost model)
        if bool(counted.any()):
            reasoning = att.estimator_inputs.reasoning_mask.sum(-1).float()
            metrics["oar/perturbation_copies"] = float(att.copies[counted].sum())
            metrics["oar/refined_share"] = float(att.refined[counted].sum() / reasoning[counted].sum().clamp(min=1))
        if len(att.shared):  # docs/method.md §14: read from the old-log-prob forward (timing_s/oar_in_old_log_prob)
            metrics["oar/shared_forward"] = float(att.shared.mean())
        if len(att.recomputed) and not bool(att.recomputed.isnan().all()):
            metrics["oar/recomputed_share"] = float(att.recomputed.nanmean())
        if len(att.policy_match) and not bool(att.policy_match.isnan().any()):
            # 1: every rank attributed with exactly the weights its old-log-prob pass used (docs/verl.md)
            metrics["oar/policy_matches_old_log_prob"] = float(att.policy_match.min())
        metrics.update(turn_metrics(att.batch, result, att.answer, self.multi_turn))
        metrics["oar/rewarded_without_span_frac"] = rewarded_without_span(
            *paid_rows_spans(att.batch, att, self.tokenizer, self.cfg.answer_patterns))
        if fidelity_due(self.cfg, global_step) and att.fidelity:  # docs/fidelity.md, "Logged while training"
            metrics.update(step_metrics(att.fidelity))
        if self.selector is not None:  # docs/auto.md, "What is logged"
            metrics.update(self.selector.metrics(global_step))
            metrics["oar/auto/calibrating"] = float(self._calibrating)  # this step scored the candidates
            if self._update_spt == self._update_spt:
                metrics["oar/auto/update_s_per_token"] = self._update_spt
        # the rows the estimator reshaped from their scores (mode=auto's plain fallback attributes and then drops them)
        due = None if att.batch.responses is None else \
            self._dumps.take(global_step, bool(att.estimator_inputs.attributed.any()))
        if due is not None:
            dumps.dump_step(self.cfg, global_step, att, result, self.tokenizer, self.default_local_dir, due)
        return metrics
