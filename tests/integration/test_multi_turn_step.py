"""One OAR step over multi-turn rows as verl's agent loop lays them out (docs/multi_turn.md): tool outputs inside the
response with ``response_mask`` 0, the row's real tokens in ``attention_mask``. verl's own legacy ``compute_advantage``
runs inside the step; the tool tokens keep GRPO's advantage bit for bit, the mass stays on the model's tokens, the span
is the last among the model's own tokens, ``oar/turns/*`` report the turns, and sessions with several outputs take
verl V1's GRPO. The worker-side unpacking of verl's layouts
(:func:`~oar_verl.integration.worker.unpack_model_masks`) is checked on both layouts."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

import verl  # noqa: F401  loads the plugin (estimator registration)
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from oar_verl.core import OARConfig, module_backend, prepare_attribution, run_attribution
from oar_verl.core.text.turns import turn_layout
from oar_verl.integration.fields import CONFIG_KEY, STEP_KEY
from oar_verl.integration.estimator import compute_oar
from oar_verl.integration.rows import BatchRows, session_finals
from oar_verl.integration.step import OARStep, rewarded_without_span, turn_metrics
from oar_verl.integration.worker import response_entropies, response_lengths, unpack_model_masks, unpack_rows
from oar_helpers import text_lm

CALL = "Let me call the calculator. <tool_call>add 3 4</tool_call>"
TOOL = "\n<tool_response>7</tool_response>\n"
TOOL_SPAN = "\n<tool_response>tool says 9. The answer is 9.</tool_response>\n"
FINAL = "so 3 plus 4 is 7. The answer is 7."
SCORES = [1.0, 0.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def setup():
    tok, model = text_lm(["What is 3 plus 4?", CALL, TOOL, TOOL_SPAN, FINAL, "so the sum is 7"] * 40)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    eos = [tok.eos_token_id]
    layouts = [  # p0: the span in the final turn / only in a tool output; p1: three turns / single-turn
        [(enc(CALL) + eos, 1), (enc(TOOL), 0), (enc(FINAL) + eos, 1)],
        [(enc(CALL) + eos, 1), (enc(TOOL_SPAN), 0), (enc("so the sum is 7") + eos, 1)],
        [(enc(CALL) + eos, 1), (enc(TOOL), 0), (enc(CALL) + eos, 1), (enc(TOOL), 0), (enc(FINAL) + eos, 1)],
        [(enc(FINAL) + eos, 1)],
    ]
    prompts = [torch.tensor(enc("What is 3 plus 4?"))] * 4
    responses = [torch.tensor([t for ids, _ in parts for t in ids]) for parts in layouts]
    masks = [torch.tensor([m for ids, m in parts for _ in ids]) for parts in layouts]
    return tok, model, prompts, responses, masks


class MultiTurnIO:
    """TrainerIO over a padded agent-loop batch: response_mask 0 on tool tokens, ``valid`` every real token."""

    def __init__(self, tok, model, prompts, responses, masks, scores):
        self.tok, self.model, self.prompts, self.responses, self.masks = tok, model, prompts, responses, masks
        T = max(len(r) for r in responses)
        self.valid = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses]).bool()
        self.response_mask = torch.stack([torch.nn.functional.pad(m, (0, T - len(m))) for m in masks]).long()
        self.response_ids = torch.tensor([r.tolist() + [tok.pad_token_id] * (T - len(r)) for r in responses])
        self.scores = torch.zeros(len(responses), T)
        self.scores[torch.arange(len(responses)), self.valid.sum(-1) - 1] = torch.tensor(scores)  # verl: rm_scores[-1]
        self.uids = np.array([f"p{i // 2}" for i in range(len(responses))], dtype=object)

    def rows(self, with_responses):
        return BatchRows(self.response_mask, self.scores, self.uids, torch.ones(len(self.uids), dtype=torch.bool),
                         self.response_ids if with_responses else None, None, self.valid)

    def dp_size(self):
        return 1

    def call_seconds(self):
        return 0.0

    def compute_importance(self, rows, options):
        cfg = OARConfig.from_mapping(options[CONFIG_KEY])
        idx = rows.tolist()
        prepared = prepare_attribution([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.tok,
                                       cfg, options[STEP_KEY], model_masks=[self.masks[i] for i in idx])
        imp = run_attribution(module_backend(self.model, cfg), prepared.batch, cfg,
                              mask_token_id=prepared.mask_token_id, seeds=prepared.seeds).importance

        def pad(xs):
            return torch.nested.as_nested_tensor(xs, layout=torch.jagged).to_padded_tensor(0.0)

        spans, lens = prepared.spans, prepared.response_lengths
        n = len(idx)
        return {"token_importance": pad(prepared.response_importance(imp)),
                "oar_reasoning_mask": pad([spans.reasoning_mask[i, :k].float() for i, k in enumerate(lens)]),
                "oar_answer_mask": pad([spans.answer_mask[i, :k].float() for i, k in enumerate(lens)]),
                "oar_span_found": spans.found.float(), "oar_answer_probe": prepared.answer_probe.float(),
                "oar_passes": torch.full((n,), 2.0)}


def algorithm(**oar):
    return OmegaConf.create({"adv_estimator": "oar", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                             "oar": oar})


def verl_advantage(io, estimator, alg, step=None, att=None, metrics=None):
    data = DataProto.from_dict(tensors={"token_level_rewards": io.scores, "response_mask": io.response_mask},
                               non_tensors={"uid": io.uids})
    if step is None:
        return compute_advantage(data, adv_estimator=estimator, num_repeat=2, config=alg).batch["advantages"]
    with step.advantage(att, 3, metrics):
        return compute_advantage(data, adv_estimator=estimator, num_repeat=2, config=alg).batch["advantages"]


@pytest.mark.parametrize("mode", ["conservative", "gradient", "perturbation"])
def test_tool_tokens_keep_grpo_and_the_mass_stays_on_the_model_s_tokens(setup, tmp_path, mode):
    tok, model, prompts, responses, masks = setup
    alg = algorithm(mode=mode, probe="as_mean", dump_every=3, dump_dir=str(tmp_path))
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None)
    io = MultiTurnIO(tok, model, prompts, responses, masks, SCORES)
    timing, metrics = {}, {}
    att = step.attribute(io, 3, timing)
    adv = verl_advantage(io, "oar", alg, step, att, metrics)
    grpo = verl_advantage(io, "grpo", algorithm())
    model_mask, context = io.response_mask.bool(), io.valid & ~io.response_mask.bool()
    assert torch.equal(adv[context], grpo[context])  # bit for bit (verl's GRPO: 0 there, and the loss masks them)
    A = grpo.sum(-1) / model_mask.sum(-1)  # each row's sequence advantage
    mass = (adv * model_mask).sum(-1) / A  # Σw over the model's tokens
    assert (mass - model_mask.sum(-1)).abs().max() / model_mask.sum(-1).max() <= 1e-6
    # the span: the last among the model's own tokens (row 1 holds one in a tool output only: not used, GRPO's
    # weights)
    lay = turn_layout(io.valid, io.response_mask)
    assert att.found.tolist() == [True, False, True, True]
    assert not (att.answer & ~lay.model).any() and not (att.estimator_inputs.reasoning_mask & lay.context).any()
    assert torch.equal(adv[1], grpo[1])
    assert float(adv[0][att.estimator_inputs.reasoning_mask[0]].std()) > 0  # the span rows are reshaped
    assert metrics["oar/adv_mass_rel_err"] <= 1e-6 and metrics["oar/no_reasoning_seq_frac"] == 0.25
    assert metrics["oar/turns/per_row"] == pytest.approx((2 + 2 + 3 + 1) / 4)
    assert metrics["oar/turns/tool_rounds_per_row"] == pytest.approx((1 + 1 + 2 + 0) / 4)
    assert metrics["oar/turns/multi_turn_rows"] == 2.0  # rows 0 and 2 (row 1 is not reshaped, row 3 single-turn)
    assert 0 < metrics["oar/turns/share_last"] < 1 and 0 < metrics["oar/turns/share_first"] < 1
    assert 0 < metrics["oar/turns/share_last_uniform"] < 1
    # the invariants the step logs on every multi-turn batch (the e2e run reads them from verl's logger)
    assert metrics["oar/turns/context_adv_max_abs_diff"] == 0.0
    assert metrics["oar/turns/context_reshaped_tokens"] == 0.0
    assert metrics["oar/turns/answer_context_tokens"] == 0.0
    assert metrics["oar/turns/answer_in_earlier_turn_frac"] == 0.0  # every span here is in its row's final turn
    # the rewarded rows without a span the model wrote (none here: row 1, whose only span is a tool's, scored 0)
    assert metrics["oar/rewarded_without_span_frac"] == 0.0
    # the token dump (the heatmap's input): whole rows, tool outputs included, marked as context by "turn"
    records = {r["sample"] + 2 * int(r["uid"][1]): r for r in
               map(json.loads, (tmp_path / "step_3.jsonl").read_text().splitlines())}
    for b, r in records.items():
        n = len(responses[b])
        assert len(r["tokens"]) == len(r["weight"]) == n
        if b == 3:  # single-turn: no "turn"
            assert "turn" not in r
            continue
        assert [t < 0 for t in r["turn"]] == (masks[b] == 0).tolist()
        assert max(r["turn"]) == lay.turns[b] - 1
        final = [i for i, t in enumerate(r["turn"]) if t == max(r["turn"])]
        assert all(i in final for i, a in enumerate(r["answer"]) if a)
        assert all(w == 1.0 for w, t in zip(r["weight"], r["turn"]) if t < 0) or all(
            w == 0.0 for w, t in zip(r["weight"], r["turn"]) if t < 0)


def test_single_turn_batches_log_no_turn_metrics_unless_the_run_is_multi_turn(setup):
    tok, model, prompts, responses, masks = setup
    valid = torch.ones(2, 4, dtype=torch.bool)
    rows = BatchRows(valid.long(), torch.zeros(2, 4), np.array(["a", "a"], dtype=object), valid[:, 0], None, None,
                     valid)
    assert turn_metrics(rows, None) == {}
    assert turn_metrics(BatchRows(valid.long(), torch.zeros(2, 4), rows.uids, valid[:, 0]), None) == {}
    # a multi-turn run's step where no row called a tool: every key, so the curves do not break
    result = compute_oar(torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 0]]), valid.long(), rows.uids, algorithm(),
                         token_importance=torch.rand(2, 4))
    got = turn_metrics(rows, result, torch.zeros(2, 4, dtype=torch.bool), multi_turn=True)
    assert got["oar/turns/tool_rounds_per_row"] == 0.0 and got["oar/turns/per_row"] == 1.0
    assert got["oar/turns/multi_turn_rows"] == 0.0 and got["oar/turns/answer_in_earlier_turn_frac"] == 0.0
    assert {"oar/turns/share_first", "oar/turns/share_last", "oar/turns/context_adv_max_abs_diff"} <= set(got)


def test_an_answer_in_an_earlier_turn_is_counted(setup):
    """The span is the last among the model's tokens; a row that answered before its final turn shows in
    ``answer_in_earlier_turn_frac`` (rows with a span), and no answer token is ever on context."""
    valid = torch.ones(2, 6, dtype=torch.bool)
    model = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]])
    answer = torch.tensor([[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    rows = BatchRows(model, torch.zeros(2, 6), np.array(["a", "a"], dtype=object), valid[:, 0], None, None, valid)
    result = compute_oar(torch.tensor([[0.0] * 5 + [1], [0.0] * 6]), model, rows.uids, algorithm(),
                         token_importance=torch.rand(2, 6), reasoning_mask=model.bool())
    got = turn_metrics(rows, result, answer)
    assert got["oar/turns/answer_in_earlier_turn_frac"] == 0.5 and got["oar/turns/answer_context_tokens"] == 0.0


def test_sessions_with_several_outputs_take_verls_grpo(setup):
    """A custom agent loop returning several outputs per session: the step's base advantage is verl V1's own
    (``compute_advantage_for_multi_trajectories``: GRPO over each session's final output, copied to the others)."""
    tok, model, prompts, responses, masks = setup
    keys = ["p0_s0_0", "p0_s0_1", "p0_s1_0", "p0_s2_0", "p1_s0_0", "p1_s0_1", "p1_s0_2", "p1_s1_0"]
    B, T = len(keys), 5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    scores = torch.zeros(B, T)
    scores[torch.arange(B), mask.sum(-1) - 1] = torch.tensor([0.3, 1.0, 0.0, 1.0, 0.9, 0.1, 1.0, 0.0])
    uids = np.array([k.split("_")[0] for k in keys], dtype=object)
    rows = BatchRows(mask, scores, uids, torch.ones(B, dtype=torch.bool), session_final=session_finals(keys))
    assert rows.session_final.tolist() == [1, 1, 2, 3, 6, 6, 6, 7]
    alg = algorithm()
    adv, ret = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None).base_advantage(rows)
    data = DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": mask},
                               non_tensors={"uid": uids})
    verl = compute_advantage_for_multi_trajectories(data, keys, "grpo", config=alg).batch["advantages"]
    assert torch.allclose(adv, verl, atol=1e-6) and torch.equal(adv, ret)
    plain = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None).base_advantage(
        dataclasses.replace(rows, session_final=None))
    assert not torch.allclose(plain[0], verl, atol=1e-3)  # every row as a group member: not verl's figure
    with pytest.raises(ValueError, match="uid"):
        session_finals(["no-index"])
    kl = algorithm()
    kl.use_kl_in_reward = True
    with pytest.raises(RuntimeError, match="use_kl_in_reward"):
        OARStep(OARConfig.from_mapping(kl.oar), kl, tok, None).base_advantage(rows)


def test_worker_reads_the_model_s_tokens_from_both_layouts(setup):
    tok, model, prompts, responses, masks = setup
    nested = TensorDict({"prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
                         "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
                         "response_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged)},
                        batch_size=[4])
    got = unpack_model_masks(nested)
    assert all(torch.equal(g, m) for g, m in zip(got, masks))
    assert response_lengths(nested) == [len(r) for r in responses]
    # the legacy trainer's padded layout: prompts left-padded, responses right-padded, attention over both
    io = MultiTurnIO(tok, model, prompts, responses, masks, SCORES)
    P = max(len(p) for p in prompts)
    pad_p = torch.stack([torch.nn.functional.pad(p, (P - len(p), 0)) for p in prompts])
    attn = torch.cat([torch.ones(4, P, dtype=torch.long), io.valid.long()], dim=1)
    entropy = torch.rand(4, io.valid.shape[1])
    padded = TensorDict({"prompts": pad_p, "responses": io.response_ids, "response_mask": io.response_mask,
                         "attention_mask": attn, "entropys": entropy}, batch_size=[4])
    got = unpack_model_masks(padded)
    assert all(torch.equal(g, m) for g, m in zip(got, masks))
    assert [len(r) for r in unpack_rows(padded)[1]] == [len(r) for r in responses]
    # the old-log-prob entropies cover every response token, tool outputs included (not response_mask.sum)
    assert [len(e) for e in response_entropies(padded)] == [len(r) for r in responses]
    assert unpack_model_masks(TensorDict({"prompts": pad_p, "responses": io.response_ids}, batch_size=[4])) is None


def test_a_group_paid_for_a_tools_answer_counts_though_not_attributed(setup):
    """``oar/rewarded_without_span_frac`` counts every paid row: a group the reward pays alike (zero advantage, so not
    attributed) for an answer only a tool printed shows, its spans located on the driver by the core's rule."""
    tok, model, prompts, responses, masks = setup
    # p0: both rows paid, the only span a tool's (row 1's layout twice); p1: a paid row with a span, an unpaid one
    rows_ids = [responses[1], responses[1], responses[0], responses[3]]
    rows_masks = [masks[1], masks[1], masks[0], masks[3]]
    io = MultiTurnIO(tok, model, prompts, rows_ids, rows_masks, [1.0, 1.0, 1.0, 0.0])
    alg = algorithm(probe="as_mean")
    step = OARStep(OARConfig.from_mapping(alg.oar), alg, tok, None, multi_turn=True)
    timing, metrics = {}, {}
    att = step.attribute(io, 3, timing)
    verl_advantage(io, "oar", alg, step, att, metrics)
    assert set(att.rows.tolist()) <= {2, 3}  # the paid-alike group p0 has a zero advantage: not attributed
    assert metrics["oar/rewarded_without_span_frac"] == pytest.approx(2 / 3)  # rows 0, 1 of the 3 paid
    assert rewarded_without_span(torch.tensor([True, False]), torch.tensor([False, False])) == 1.0
    assert rewarded_without_span(torch.tensor([False, False]), torch.tensor([False, False])) == 0.0
