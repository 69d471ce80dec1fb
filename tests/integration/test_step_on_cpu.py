"""One OAR step (oar_verl.integration.step) around verl's real advantage step, with an in-process TrainerIO.

The IO runs the same preparation and attribution as the worker RPC, on a tiny model in this process (the RPC itself is
covered by test_worker_group_on_cpu and the e2e runs); verl's own legacy ``compute_advantage`` runs inside the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401  loads the plugin (estimator registration)
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from oar_verl.core import OARConfig, module_backend, prepare_attribution, run_attribution
from oar_verl.integration import handoff
from oar_verl.integration.rows import BatchRows, call_seconds
from oar_verl.integration.step import OARStep
from oar_verl.integration.fields import AUTO_KEY, CONFIG_KEY, SECONDS_FIELD, STEP_KEY
from oar_helpers import text_lm

PROMPTS = ["What is 3 plus 4?", "What is 3 plus 4?", "What is 5 plus 1?", "What is 5 plus 1?"]
RESPONSES = ["3 plus 4 is 7. The answer is 7.", "3 plus 4 is 8. The answer is 8.", "5 plus 1 is 6. #### 6",
             "5 plus 1 is 6. #### 6"]
SCORES = [1.0, 0.0, 1.0, 1.0]  # the second group agrees: zero advantage, never attributed


class InProcessIO:
    """TrainerIO over a padded batch: the worker's preparation and attribution, run here."""

    def __init__(self, tok, model, prompts, responses, scores, dp_size=2):
        self.tok, self.model, self.prompts, self.responses = tok, model, prompts, responses
        T = max(len(r) for r in responses)
        self.response_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
        self.response_ids = torch.tensor([r.tolist() + [tok.pad_token_id] * (T - len(r)) for r in responses])
        self.scores = torch.zeros(len(responses), T)
        self.scores[torch.arange(len(responses)), self.response_mask.sum(-1) - 1] = torch.tensor(scores)
        self.uids = np.array([f"p{i // 2}" for i in range(len(responses))], dtype=object)
        self.calls: list[tuple[list[int], dict]] = []
        self._dp = dp_size
        self.log_prob_weights = 1.5  # what the worker reports for its last old-log-prob pass
        self.log_prob_out = None  # the old-log-prob call's outputs of every row, when it carried attribution

    def rows(self, with_responses):
        return BatchRows(self.response_mask, self.scores, self.uids, torch.ones(len(self.uids), dtype=torch.bool),
                         self.response_ids if with_responses else None)

    def dp_size(self):
        return self._dp

    def call_seconds(self):
        return call_seconds(self.log_prob_out)

    def compute_importance(self, rows, options):
        self.calls.append((rows.tolist(), options))
        cfg = OARConfig.from_mapping(json.loads(json.dumps(options[CONFIG_KEY])))
        idx = rows.tolist()
        prepared = prepare_attribution([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.tok,
                                       cfg, options[STEP_KEY])
        imp = run_attribution(module_backend(self.model, cfg), prepared.batch, cfg, mask_token_id=prepared.mask_token_id,
                              seeds=prepared.seeds).importance

        def pad(xs):
            return torch.nested.as_nested_tensor(xs, layout=torch.jagged).to_padded_tensor(0.0)

        spans, lens = prepared.spans, prepared.response_lengths
        return {"token_importance": pad(prepared.response_importance(imp)),
                "oar_reasoning_mask": pad([spans.reasoning_mask[i, :n].float() for i, n in enumerate(lens)]),
                "oar_answer_mask": pad([spans.answer_mask[i, :n].float() for i, n in enumerate(lens)]),
                "oar_span_found": spans.found.float(), "oar_answer_probe": prepared.answer_probe.float(),
                "oar_passes": torch.full((len(idx),), 2.0),
                "oar_params_fingerprint": torch.full((len(idx),), 1.5, dtype=torch.float64),
                "oar_log_prob_params_fingerprint": torch.full((len(idx),), self.log_prob_weights, dtype=torch.float64)}


@pytest.fixture(scope="module")
def setup():
    tok, model = text_lm([*PROMPTS, *RESPONSES] * 40)
    enc = lambda t: torch.tensor(tok.encode(t, add_special_tokens=False))  # noqa: E731
    prompts = [enc(p) for p in PROMPTS]
    responses = [torch.cat([enc(r), torch.tensor([tok.eos_token_id])]) for r in RESPONSES]
    return tok, model, prompts, responses


def algorithm(**oar):
    return OmegaConf.create({"adv_estimator": "oar", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                             "oar": oar})


def run_step(step, io, global_step=3):
    timing, metrics = {}, {}
    data = DataProto.from_dict(tensors={"token_level_rewards": io.scores, "response_mask": io.response_mask},
                               non_tensors={"uid": io.uids})
    att = step.attribute(io, global_step, timing)  # right after the old-log-prob pass
    with step.advantage(att, global_step, metrics):
        out = compute_advantage(data, adv_estimator="oar", num_repeat=2, config=step.algorithm)
    return out, att, timing, metrics


@pytest.mark.parametrize("mode", ["gradient", "perturbation"])
def test_one_step_reads_top_to_bottom(setup, tmp_path, mode):
    tok, model, prompts, responses = setup
    alg = algorithm(mode=mode, probe="as_mean", dump_every=3, dump_dir=str(tmp_path))
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, str(tmp_path))
    io = InProcessIO(tok, model, prompts, responses, SCORES)
    out, att, timing, metrics = run_step(step, io)
    # selection: only the mixed group (rows 0, 1) has non-zero advantages; DP=2 needs no top-up
    assert [c[0] for c in io.calls] == [[0, 1]]
    assert timing["oar"] > 0 and handoff.current() is None
    adv = out.batch["advantages"]
    assert torch.equal(adv[2:], torch.zeros_like(adv[2:]))  # zero-advantage rows untouched
    mask = io.response_mask.bool()
    seq = (adv * mask).sum(-1) / mask.sum(-1)
    reasoning = att.estimator_inputs.reasoning_mask
    for b in (0, 1):  # mass preserved, non-uniform weights
        w = adv[b][reasoning[b]] / adv[b][mask[b]][-1]
        assert abs(float(w.sum()) - int(reasoning[b].sum())) < 1e-3 and float(w.std()) > 1e-3
    assert seq[0] > 0 > seq[1]
    assert metrics["oar/attributed_seq_frac"] == 0.5 and metrics["oar/answer_probe_frac"] == 1.0
    assert metrics["oar/adv_mass_rel_err"] < 1e-6 and metrics["oar/span_found_frac"] == 1.0
    assert metrics["oar/global_step"] == 3.0 and metrics["oar/passes_max"] == metrics["oar/passes_min"] == 2.0
    assert metrics["oar/policy_matches_old_log_prob"] == 1.0
    # the step's own RPC attributed: nothing inside verl's old-log-prob call, the total is the step's own part
    assert timing["oar_in_old_log_prob"] == 0.0 and timing["oar_total"] == timing["oar"]
    dumped = [json.loads(line) for line in (tmp_path / "step_3.jsonl").read_text().splitlines()]
    assert {d["uid"] for d in dumped} == {"p0"}


def test_a_row_without_an_answer_span_keeps_grpo_weights_and_is_logged(setup):
    """A truncated row without an answer span (docs/method.md §2) in a mixed group: the worker's preparation gives it
    no reasoning token, verl's advantage step leaves its advantage uniform (GRPO's), the row with a span is reshaped,
    and the step's ``oar/*`` report counts it (``no_reasoning_seq_frac``) beside ``span_found_frac``."""
    tok, model, prompts, responses = setup
    cut = responses[1][:6]  # "3 plus 4 is 8..." cut at the length limit: no EOS, no answer
    alg = algorithm(mode="gradient", probe="as_mean")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = InProcessIO(tok, model, prompts, [responses[0], cut, *responses[2:]], SCORES)
    out, att, _, metrics = run_step(step, io)
    assert [c[0] for c in io.calls] == [[0, 1]] and att.found[:2].tolist() == [True, False]
    adv, mask = out.batch["advantages"], io.response_mask.bool()
    assert not att.estimator_inputs.reasoning_mask[1].any()
    assert (adv[1][mask[1]] == adv[1][0]).all() and adv[1][0] < 0  # uniform: GRPO's advantage on every token
    assert float(adv[0][att.estimator_inputs.reasoning_mask[0]].std()) > 1e-4  # the span row is reshaped
    assert metrics["oar/no_reasoning_seq_frac"] == 0.25 and metrics["oar/span_found_frac"] == 0.5
    assert metrics["oar/reshaped_seq_frac"] == 0.25 and metrics["oar/adv_mass_rel_err"] < 1e-6


def test_top_up_and_kl_in_reward_and_no_work(setup, tmp_path):
    tok, model, prompts, responses = setup
    alg = algorithm(mode="gradient")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = InProcessIO(tok, model, prompts, responses, SCORES, dp_size=4)
    run_step(step, io)
    assert io.calls[0][0] == [0, 1, 2, 3]  # topped up to a multiple of DP=4 with the other rows
    # with a KL penalty in the reward every row has an advantage: all rows attributed, base computed by the estimator
    kl = algorithm(mode="gradient")
    kl.use_kl_in_reward = True
    io_kl = InProcessIO(tok, model, prompts, responses, SCORES)
    _, att, _, _ = run_step(OARStep(OARConfig.from_mapping(kl.oar), kl, tok, None), io_kl)
    assert io_kl.calls[0][0] == [0, 1, 2, 3] and att.estimator_inputs.base_advantages is None
    # every group agrees: nothing to attribute, no RPC, still every metric
    io_none = InProcessIO(tok, model, prompts, responses, [1.0, 1.0, 0.0, 0.0])
    out, _, _, metrics = run_step(step, io_none)
    assert io_none.calls == [] and metrics["oar/attributed_seq_frac"] == 0.0 and metrics["oar/ess_ratio"] == 1.0
    assert torch.equal(out.batch["advantages"], torch.zeros_like(out.batch["advantages"]))


def test_attribution_inside_the_old_log_prob_call_is_timed_beside_the_step_s_own(setup):
    """Where the workers attributed inside verl's old-log-prob call (the shared forward), the slowest rank's seconds
    there (``oar_seconds``, every row of a rank alike, read from every row of the call's output: also a rank none of
    whose rows the step selects, and a step that selects none) are ``timing_s/oar_in_old_log_prob``, and with the
    step's own part ``timing_s/oar_total``; several sub-steps of one verl step add up, as verl's timers do."""
    tok, model, prompts, responses = setup
    alg = algorithm(mode="gradient")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = InProcessIO(tok, model, prompts, responses, SCORES)
    # rank 0 holds rows 0-1 (selected), rank 1 rows 2-3 (zero advantage, not selected) and was the slower one
    io.log_prob_out = {SECONDS_FIELD: torch.tensor([0.25, 0.25, 0.75, 0.75], dtype=torch.float64)}
    _, _, timing, _ = run_step(step, io)
    assert timing["oar_in_old_log_prob"] == 0.75 and timing["oar_total"] == timing["oar"] + 0.75
    step.attribute(io, 3, timing)  # a second sub-step of the same verl step (parameter_sync_step > 1)
    assert timing["oar_in_old_log_prob"] == 1.5 and timing["oar_total"] == timing["oar"] + 1.5
    # every group agrees: no row selected, but the pass still carried its backwards
    none = InProcessIO(tok, model, prompts, responses, [1.0, 1.0, 0.0, 0.0])
    none.log_prob_out = io.log_prob_out
    _, _, timing, _ = run_step(step, none)
    assert none.calls == [] and timing["oar_in_old_log_prob"] == 0.75
    assert call_seconds(None) == 0.0 and call_seconds({SECONDS_FIELD: torch.zeros(0)}) == 0.0


def test_policy_consistency_is_reported_as_it_was_seen(setup):
    tok, model, prompts, responses = setup
    alg = algorithm(mode="gradient")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = InProcessIO(tok, model, prompts, responses, SCORES)
    io.log_prob_weights = 2.5  # the weights changed between the old-log-prob pass and attribution
    assert run_step(step, io)[3]["oar/policy_matches_old_log_prob"] == 0.0
    io.log_prob_weights = float("nan")  # no old-log-prob pass (rollout-correction bypass mode): not reported
    assert "oar/policy_matches_old_log_prob" not in run_step(step, io)[3]


def test_a_failing_advantage_step_closes_the_handoff(setup):
    tok, model, prompts, responses = setup
    alg = algorithm(mode="gradient")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = InProcessIO(tok, model, prompts, responses, SCORES)
    att = step.attribute(io, 1, {})
    with pytest.raises(ZeroDivisionError):
        with step.advantage(att, 1, {}):
            1 / 0
    assert handoff.current() is None
    with pytest.raises(RuntimeError, match="did not run the `oar` estimator"):
        with step.advantage(att, 1, {}):
            pass


class AutoIO(InProcessIO):
    """InProcessIO that also answers a mode=auto calibration request as the worker does (measure_candidates, then the
    worker's own ``oar_auto_*`` fields)."""

    def rows(self, with_responses):
        self.lengths = torch.tensor([len(p) + len(r) for p, r in zip(self.prompts, self.responses)])
        return dataclasses.replace(super().rows(with_responses), lengths=self.lengths)

    def compute_importance(self, rows, options):
        from oar_verl.core.auto.measure import measure_candidates
        from oar_verl.integration.worker import auto_fields

        out = super().compute_importance(rows, options)
        cfg = OARConfig.from_mapping(json.loads(json.dumps(options[CONFIG_KEY])))
        idx = rows.tolist()
        auto = options.get(AUTO_KEY)
        measured = None
        if auto:
            p, r = [self.prompts[i] for i in idx], [self.responses[i] for i in idx]
            has = torch.ones(len(idx), dtype=torch.bool)
            measured = measure_candidates(p, r, self.tok, cfg, options[STEP_KEY], auto["candidates"],
                                          lambda c, prep: module_backend(self.model, c), has_reasoning=has)
        return {**out, **auto_fields(measured, auto["candidates"] if auto else [], len(idx))}


def test_mode_auto_calibrates_decides_rechecks_and_resumes(setup, tmp_path, capsys):
    from oar_verl.core.auto import UNIFORM
    from oar_verl.core.config import OARConfigError
    from oar_verl.integration.fields import AUTO_KEY as KEY

    tok, model, prompts, responses = setup
    alg = algorithm(mode="auto", probe="as_mean", auto_rows=2, auto_prompts=1, auto_every=2, auto_fallback="best",
                    fidelity_rows=2, auto_candidates=["fisher", "gradient"], auto_default="fisher")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    with pytest.raises(OARConfigError, match="mode=auto is decided by the OAR trainer step"):
        step.worker_options(1)  # nothing sends mode=auto to a worker
    io = AutoIO(tok, model, prompts, responses, SCORES)
    _, att, timing, metrics = run_step(step, io, global_step=1)
    assert math.isnan(metrics["oar/auto/all/cost/fisher"])  # no actor update timed yet: the cost is unknown
    timing["update_actor"] = 0.5  # verl times the update after the attribution, in the step's dict
    rows, options = io.calls[0]
    assert options[CONFIG_KEY]["mode"] == "fisher" and options[KEY] == {"candidates": ["fisher", "gradient"]}
    assert metrics["oar/auto/calibrating"] == 1 and metrics["oar/auto/all/decided"] == 1
    assert metrics["oar/auto/all/rows"] == 2 and metrics["oar/auto/all/prompts"] == 1
    assert {"oar/auto/all/gain/fisher/random", "oar/auto/all/gain/gradient/position_lo"} <= set(metrics)
    assert "oar auto [all] step 1: DECIDED" in capsys.readouterr().out
    chosen = step.selector.mode("all")
    assert chosen in ("fisher", "gradient") and metrics[f"oar/auto/all/mode/{chosen}"] == 1
    assert metrics["oar/attributed_seq_frac"] == 0.5 and metrics["oar/adv_mass_rel_err"] < 1e-6
    # the next step attributes with the decision and measures nothing; the re-check comes auto_every steps later.
    # Only that step reads its scores from the old-log-prob pass, when the decision can (docs/method.md §14)
    assert step.shared_mode(3) is None  # the re-check scores every candidate
    assert step.shared_mode(2) == chosen  # fisher its scores, OAR-G its clean teachers
    assert step.shared_options(2)[CONFIG_KEY]["mode"] == chosen
    _, _, _, metrics = run_step(step, io, global_step=2)
    assert io.calls[1][1][CONFIG_KEY]["mode"] == chosen and KEY not in io.calls[1][1]
    assert metrics["oar/auto/calibrating"] == 0
    _, _, _, metrics = run_step(step, io, global_step=3)
    assert KEY in io.calls[2][1] and metrics["oar/auto/update_s_per_token"] == 0.5 / (io.lengths.sum() / 2)
    assert 0 < metrics["oar/auto/all/cost/gradient"] < float("inf")  # seconds per token over the update's
    # a resumed run keeps the decision
    path = step.save_state(str(tmp_path / "global_step_3"))
    again = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    assert again.load_state(str(tmp_path / "global_step_3")) and again.selector.modes() == step.selector.modes()
    assert json.dumps(again.selector.state_dict()) == json.dumps(step.selector.state_dict())
    # the plain-GRPO fallback: those rows are not attributed and keep the base advantage
    state = json.loads(open(path).read())
    state["bands"]["all"].update(mode=UNIFORM, next_check=10**6)
    again.selector.load_state_dict(state)
    io_plain = AutoIO(tok, model, prompts, responses, SCORES)
    out, att, _, metrics = run_step(again, io_plain, global_step=5)
    assert io_plain.calls == [] and not att.estimator_inputs.attributed.any()
    assert metrics["oar/auto/all/mode/grpo"] == 1 and metrics["oar/auto/all/mode_index"] == -1
    base = step.base_advantage(io_plain.rows(False))[0]
    torch.testing.assert_close(out.batch["advantages"], base)


def test_mode_auto_attributes_each_sliding_window_band_with_its_own_mode(setup):
    """A model with a window: rows inside and past it go to separate RPCs with their bands' modes, and each row's
    importance comes back from its own band's call (not from another call's data-parallel top-up)."""
    tok, model, prompts, responses = setup
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    window = (max(lengths[:2]) + min(lengths[2:])) // 2  # the first prompt's rows are past it, the second's inside
    assert min(lengths[:2]) > window >= max(lengths[2:])
    alg = algorithm(mode="auto", probe="as_mean", auto_every=100, auto_candidates=["fisher", "gradient"])
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None, window=window)
    state = step.selector.state_dict()
    state["bands"]["inside"].update(mode="fisher", decided=True, next_check=10**6)
    state["bands"]["past"].update(mode="gradient", decided=True, next_check=10**6)
    step.selector.load_state_dict(state)
    io = AutoIO(tok, model, prompts, responses, [1.0, 0.0, 1.0, 0.0])
    _, att, _, metrics = run_step(step, io, global_step=2)
    modes = {options[CONFIG_KEY]["mode"]: rows for rows, options in io.calls}
    assert modes == {"gradient": [0, 1], "fisher": [2, 3]} and not any(AUTO_KEY in o for _, o in io.calls)
    for mode, rows in modes.items():  # each row's importance is its band's mode's
        cfg = OARConfig.from_mapping({**alg.oar, "mode": mode})
        prepared = prepare_attribution([prompts[i] for i in rows], [responses[i] for i in rows], tok, cfg, 2)
        imp = run_attribution(module_backend(model, cfg), prepared.batch, cfg, mask_token_id=prepared.mask_token_id,
                              seeds=prepared.seeds).importance
        want = prepared.response_importance(imp)
        for j, i in enumerate(rows):
            n = len(responses[i])
            torch.testing.assert_close(att.estimator_inputs.token_importance[i, :n], want[j][:n].float())
    assert metrics["oar/auto/inside/mode/fisher"] == 1 and metrics["oar/auto/past/mode/gradient"] == 1


def test_which_steps_read_attribution_from_the_old_log_prob_pass(setup):
    """docs/method.md §14: a method that can, fidelity steps included, unless switched off; under mode=auto a step
    that does not calibrate and whose bands all run one such method."""
    from oar_verl.core.auto import UNIFORM

    tok = setup[0]

    def step_of(window=None, **oar):
        alg = algorithm(**oar)
        return OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None, window=window)

    def shares(step=3, **oar):
        return step_of(**oar).shared_mode(step)

    assert shares(mode="fisher") == "fisher" and shares(mode="conservative") == "conservative"
    assert shares(mode="gradient") == "gradient"  # its clean teachers (Method.shared_teacher)
    assert shares(mode="perturbation") is shares(mode="path") is None
    assert shares(mode="fisher", shared_forward=False) is None
    # target=reference attributes rows ending in the ground truth, which the pass of the model's rows does not hold
    assert shares(mode="fisher", target="reference") is shares(mode="conservative", target="reference") is None
    assert shares(step=4, mode="fisher", fidelity_every=2) == "fisher"  # the worker measures right after the pass
    options = step_of(mode="fisher").shared_options(3)
    assert options[CONFIG_KEY]["mode"] == "fisher" and options[STEP_KEY] == 3
    auto = step_of(mode="auto", auto_candidates=["fisher", "conservative"], auto_every=100)
    assert auto.shared_mode(1) is None and auto.shared_options(1) is None  # undecided: every step calibrates
    for band in auto.selector._bands.values():  # as after a decision at step 1, the next check at step 101
        band.update(decided=True, collecting=False, next_check=101, mode="conservative")
    assert auto.shared_mode(2) == "conservative" and auto.shared_options(2)[CONFIG_KEY]["mode"] == "conservative"
    assert auto.shared_mode(101) is None  # the check's step scores every candidate
    windowed = step_of(mode="auto", auto_candidates=["fisher", "gradient"], auto_every=100, window=16)
    for band, mode in zip(windowed.selector._bands.values(), ("fisher", "gradient")):
        band.update(decided=True, collecting=False, next_check=101, mode=mode)
    assert windowed.shared_mode(2) is None  # the bands run different methods: one pass cannot hold both
    for band in windowed.selector._bands.values():
        band.update(mode="fisher")
    assert windowed.shared_mode(2) == "fisher"
    next(iter(windowed.selector._bands.values())).update(mode=UNIFORM)  # a band on the plain-GRPO fallback
    assert windowed.shared_mode(2) is None


def test_oar_g_marks_the_rows_the_step_reads_for_its_passes_after_the_pass(setup):
    """OAR-G reads only its clean teachers from the old-log-prob pass: the step marks the rows it will read (the
    zero-advantage group left out) for the worker's noisy passes; a method read whole from the pass marks none (it
    scores every row of the pass); without the base advantage (a KL penalty in the reward) every eligible row."""
    tok, model, prompts, responses = setup
    io = InProcessIO(tok, model, prompts, responses, SCORES)

    def step_of(kl=False, **oar):
        alg = algorithm(**oar)
        alg.use_kl_in_reward = kl
        return OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)

    assert step_of(mode="gradient").teacher_rows(io, 3).tolist() == [True, True, False, False]
    assert step_of(mode="gradient", skip_zero_advantage=False).teacher_rows(io, 3).tolist() == [True] * 4
    assert step_of(kl=True, mode="gradient").teacher_rows(io, 3).tolist() == [True] * 4
    assert step_of(mode="fisher").teacher_rows(io, 3) is None
    assert step_of(mode="gradient", shared_forward=False).teacher_rows(io, 3) is None


def test_an_engine_that_cannot_carry_attribution_in_its_pass_says_why():
    from oar_verl.integration.backends import ENGINE_BACKENDS

    fsdp, megatron = ENGINE_BACKENDS.get("fsdp2"), ENGINE_BACKENDS.get("megatron")
    cfg = OARConfig(mode="fisher")

    class Engine:  # verl's FSDP engine without sequence parallelism has no Ulysses group
        ulysses_sequence_parallel_size, module = 1, None

    assert fsdp.shared_error(Engine(), cfg, fused_kernels=False, packed=True, tokens=(8, 8)) is None
    assert "use_fused_kernels=true" in fsdp.shared_error(Engine(), cfg, fused_kernels=True, packed=True,
                                                         tokens=(8, 8))

    class Sharded:  # under Ulysses (verl requires remove-padding there): sharded like verl's own pass
        ulysses_sequence_parallel_size, ulysses_parallel_group, module = 2, None, None
        ulysses_device_mesh = {"sp": type("Mesh", (), {"get_local_rank": lambda self: 1})()}

    assert fsdp.shared_error(Sharded(), cfg, fused_kernels=False, packed=True, tokens=(8, 8)) is None
    assert "without use_remove_padding" in fsdp.shared_error(Sharded(), cfg, fused_kernels=False, packed=False,
                                                             tokens=(8, 8))
    # Megatron's schedule runs one backward per micro-batch: fisher with one loss column shares, more do not
    assert megatron.shared_error(None, cfg, fused_kernels=False, packed=True, tokens=(8, 8)) is None
    two = OARConfig(mode="fisher", fisher_outcomes=1, fisher_sketches=1)
    assert "reads 2 backwards per row" in megatron.shared_error(None, two, fused_kernels=False,
                                                                            packed=True, tokens=(8, 8))
    # its backward keeps the pass's activations: micro-batches larger than the update's only with full recompute
    plain, full = (SimpleNamespace(tf_config=SimpleNamespace(recompute_granularity=g)) for g in (None, "full"))
    assert "hold up to 4096 tokens, the update's 2048" in megatron.shared_error(plain, cfg, fused_kernels=False,
                                                                                packed=True, tokens=(4096, 2048))
    assert megatron.shared_error(full, cfg, fused_kernels=False, packed=True, tokens=(4096, 2048)) is None
    assert megatron.shared_error(plain, cfg, fused_kernels=False, packed=True, tokens=(2048, 2048)) is None
    # OAR-G's clean teachers are read from FSDP's pass only; on Megatron its passes follow the pass in the same call
    oar_g = OARConfig(mode="gradient")
    assert fsdp.shared_error(Engine(), oar_g, fused_kernels=False, packed=True, tokens=(8, 8)) is None
    assert "reads only its clean teachers" in megatron.shared_error(plain, oar_g, fused_kernels=False, packed=True,
                                                                    tokens=(8, 8))


def test_a_plain_grpo_fallback_step_writes_no_empty_dump(setup, tmp_path, capsys):
    """mode=auto whose band fell back to plain GRPO: a re-check step attributes the rows to score the candidates and
    then reshapes none of them. A dump is due on every step; neither step may write an empty file, and the dump
    waits for a step whose rows the estimator reshaped from their scores."""
    from oar_verl.core.auto import UNIFORM

    tok, model, prompts, responses = setup
    alg = algorithm(mode="auto", probe="as_mean", auto_rows=2, auto_prompts=1, auto_every=2, auto_fallback="best",
                    auto_candidates=["fisher", "gradient"], auto_default="fisher", dump_every=1,
                    dump_dir=str(tmp_path / "dumps"))
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    state = step.selector.state_dict()
    state["bands"]["all"].update(mode=UNIFORM, decided=True, collecting=False, next_check=6)
    step.selector.load_state_dict(state)
    for global_step in (5, 6):  # the fallback, then the re-check: rows attributed for the candidates only
        _, att, _, metrics = run_step(step, AutoIO(tok, model, prompts, responses, SCORES), global_step=global_step)
        assert not att.estimator_inputs.attributed.any()
    assert len(att.rows) and metrics["oar/auto/calibrating"] == 1
    assert not (tmp_path / "dumps").exists()
    said = capsys.readouterr().out
    assert "no row reshaped from its scores at step 5 (every prompt group's rewards tied, or mode=auto's plain-GRPO " \
        "fallback)" in said and "(algorithm.oar.dump_every=1)" in said
