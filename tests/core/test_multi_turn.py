"""Multi-turn rows (verl's agent loop, OpenRLHF's agent path; docs/multi_turn.md): the row layout of
``oar_verl.core.text.turns`` and every step that reads it. Tool outputs, user turns and the template between turns
are context: never reasoning, never replaced by a mask operator or a fidelity deletion, never scored, never reshaped
(their base advantage kept bit for bit) and never in the mass (Σw = R over the model's reasoning tokens); the answer
span is the last among the model's own tokens (never in a tool output, never across one); a row with no span in its
own tokens keeps w = 1 (docs/method.md §2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oar_verl.core import OARConfig, attribute, module_backend, oar_advantages, prepare_attribution
from oar_verl.core.batch.layout import build_reference_responses
from oar_verl.core.text.spans import locate_answer_spans
from oar_verl.core.text.turns import split_segments_at_turns, turn_layout, turn_shares
from oar_verl.quickstart.tokenizers import train_tiny_bpe

MODES = ("conservative", "fisher", "gradient", "perturbation", "path")


@pytest.fixture(scope="module")
def tok():
    texts = ["What is 3 plus 4? Let me call the calculator. <tool_call>add 3 4</tool_call>",
             "<tool_response>7</tool_response> so 3 plus 4 is 7. The answer is 7.", "#### 12", "tool says 9"] * 40
    return train_tiny_bpe(texts, vocab_size=320)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def multi_turn_rows(tok):
    """(prompts, responses, model masks, names): one row per layout, each response built part by part, the model's
    parts with mask 1 and the tool outputs (with the chat-template tokens around them) with mask 0."""
    eos = [tok.eos_token_id]
    call = enc(tok, "Let me call the calculator. <tool_call>add 3 4</tool_call>") + eos
    tool = enc(tok, "\n<tool_response>7</tool_response>\n")
    tool_span = enc(tok, "\n<tool_response>tool says 9. The answer is 9.</tool_response>\n")  # a span in a tool output
    final = enc(tok, "so 3 plus 4 is 7. The answer is 7.") + eos
    final_no_span = enc(tok, "so the sum is 7") + eos
    layouts = {
        "two_turns": [(call, 1), (tool, 0), (final, 1)],
        "three_turns": [(call, 1), (tool, 0), (call, 1), (tool, 0), (final, 1)],
        "span_only_in_tool": [(call, 1), (tool_span, 0), (final_no_span, 1)],
        "truncated_in_tool": [(call, 1), (tool_span[:5], 0)],
        "single_turn": [(final, 1)],
    }
    prompts, responses, masks = [], [], []
    for parts in layouts.values():
        prompts.append(torch.tensor(enc(tok, "What is 3 plus 4?")))
        responses.append(torch.tensor([t for ids, _ in parts for t in ids]))
        masks.append(torch.tensor([m for ids, m in parts for _ in ids]))
    return prompts, responses, masks, list(layouts)


def padded(rows: list[torch.Tensor], fill=0) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def test_turn_layout_runs_final_turn_and_context():
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    model = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    lay = turn_layout(valid, model)
    assert lay.turn.tolist() == [[0, 0, -1, -1, 1, -1, 2, -1], [0, 0, -1, -1, -1, -1, -1, -1],
                                 [0, 0, -1, -1, -1, -1, -1, -1]]
    assert lay.turns.tolist() == [3, 1, 1] and lay.context_runs.tolist() == [2, 1, 0]
    assert lay.final.long().tolist() == [[0, 0, 0, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert (lay.context == (valid.bool() & ~model.bool())).all()
    single = turn_layout(valid)  # without a model mask every valid token is the model's: one turn per row
    assert single.turns.tolist() == [1, 1, 1] and torch.equal(single.final, valid.bool())


def test_segments_never_cross_a_turn():
    seg = torch.tensor([[0, 0, -1, -1, 0, 1, 1, -1, 2, 2]])
    turn = torch.tensor([[0, 0, -1, -1, 1, 1, 1, -1, 2, 2]])
    assert split_segments_at_turns(seg, turn).tolist() == [[0, 0, -1, -1, 1, 2, 2, -1, 3, 3]]
    same = torch.tensor([[0, 0, 1, 1, 2, -1]])
    assert torch.equal(split_segments_at_turns(same, torch.tensor([[0, 0, 0, 0, 0, -1]])), same)
    empty = torch.zeros(0, 4, dtype=torch.long)
    assert split_segments_at_turns(empty, empty).shape == (0, 4)


def test_spans_are_the_last_among_the_models_own_tokens(tok):
    prompts, responses, masks, names = multi_turn_rows(tok)
    eos = [tok.eos_token_id]
    tool = enc(tok, "\n<tool_response>7</tool_response>\n")
    extra = {  # answered in an earlier turn, then a final turn without one; a marker and a value split by a tool
        "answered_earlier": [(enc(tok, "3 plus 4 is 7. The answer is 7. <tool_call>add 3 4</tool_call>") + eos, 1),
                             (tool, 0), (enc(tok, "so the sum is 7") + eos, 1)],
        "split_by_tool": [(enc(tok, "so The answer is"), 1), (tool, 0), (enc(tok, "7") + eos, 1)],
    }
    for parts in extra.values():
        responses.append(torch.tensor([t for ids, _ in parts for t in ids]))
        masks.append(torch.tensor([m for ids, m in parts for _ in ids]))
    names += list(extra)
    ids, valid, model = padded(responses), padded([torch.ones_like(r) for r in responses]), padded(masks)
    spans = locate_answer_spans(ids, valid, tok, ("answer_is",), model_mask=model)
    found = dict(zip(names, spans.found.tolist()))
    # the span inside a tool output is never used, nor a match across one; an earlier turn's answer is the row's
    # when no later turn of the model has one (the recipes' reward grades the last `#### N` of the model's text)
    assert found == {"two_turns": True, "three_turns": True, "span_only_in_tool": False, "truncated_in_tool": False,
                     "single_turn": True, "answered_earlier": True, "split_by_tool": False}
    lay = turn_layout(valid, model)
    assert not (spans.reasoning_mask & lay.context).any() and not (spans.answer_mask & ~lay.model).any()
    for b, name in enumerate(names):
        if spans.found[b]:
            assert tok.decode(ids[b][spans.answer_mask[b]]).strip() == "7"
            answer_turn = int(lay.turn[b][spans.answer_mask[b]].max())
            # every earlier turn's tokens but EOS are reasoning; the answer's turn up to its marker; none after it
            earlier = lay.model[b] & (lay.turn[b] < answer_turn) & (ids[b] != tok.eos_token_id)
            assert spans.reasoning_mask[b][earlier].all()
            assert not spans.reasoning_mask[b][lay.turn[b] > answer_turn].any()
            assert (answer_turn == int(lay.turns[b]) - 1) == (name != "answered_earlier")
    # the single-turn row, and a batch without a model mask, as before: bit for bit
    single = names.index("single_turn")
    alone = locate_answer_spans(ids[single:single + 1], valid[single:single + 1], tok, ("answer_is",))
    assert torch.equal(alone.reasoning_mask, spans.reasoning_mask[single:single + 1])
    assert torch.equal(alone.answer_mask, spans.answer_mask[single:single + 1])


class Spy:
    """A backend that records every pass's replaced positions (OAR-P's and fisher's masked copies, the fidelity
    metric's deletions go through ``run`` with their replaced tokens, or as rebuilt batches) and the batches run."""

    def __init__(self, inner):
        self.inner, self.replaced, self.batches = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, batch, passes, on_probe, hook=None):
        self.batches.append(batch)
        for p in passes:
            r = p.replaced()
            if r is not None:
                self.replaced.append((batch, p.rows, r))
        return self.inner.run(batch, passes, on_probe, hook)


def full_context(prepared, model_masks) -> torch.Tensor:
    """(B, L) bool the context tokens of each row in the attribution batch's columns."""
    B, L = prepared.batch.input_ids.shape
    P = prepared.batch.response_start
    ctx = torch.zeros(B, L, dtype=torch.bool)
    for b, m in enumerate(model_masks):
        ctx[b, P:P + len(m)] = m == 0
    return ctx


@pytest.mark.parametrize("mode", MODES)
def test_tool_tokens_are_context_in_every_mode(tok, make_lm, mode):
    prompts, responses, masks, names = multi_turn_rows(tok)
    cfg = OARConfig(mode=mode, probe="as_mean", answer_patterns=("answer_is",), fidelity_every=1, fidelity_rows=8,
                    **({"perturbation": "hierarchical", "segment_min_tokens": 1} if mode == "perturbation" else {}))
    model = make_lm(torch.float64, vocab=len(tok))
    spies = []

    def backend(prepared):
        spies.append(Spy(module_backend(model, cfg)))
        return spies[-1]

    att = attribute(backend, prompts, responses, tok, cfg, 0, model_masks=masks)
    prepared = att.prepared
    ctx = full_context(prepared, masks)
    assert not (prepared.batch.reasoning_mask & ctx).any()
    if prepared.batch.segments is not None:  # OAR-P's segments: inside one turn each, never on a tool token
        assert not ((prepared.batch.segments >= 0) & ctx).any()
    # the probe reads the final turn's answer tokens (AS-Mean's positions predict them)
    assert prepared.spans.found.tolist() == [True, True, False, False, True]
    fid = att.fidelity(cfg, 1)  # the in-step deletion metric: its removals are reasoning tokens only
    assert torch.isnan(fid["gain"][2:4]).all() and not torch.isnan(fid["gain"][0])  # rows without a span: left out
    if mode == "perturbation":  # masked copies, and the fidelity's mean-operator removals, were run and checked
        assert len(spies[0].replaced) > 0
    for batch, rows, replaced in spies[0].replaced:  # no mask operator ever replaces a context token
        full = full_context(prepared, masks) if batch.input_ids.shape == prepared.batch.input_ids.shape else None
        assert not (replaced & ~batch.reasoning_mask[rows]).any()
        if full is not None:
            assert not (replaced & full[rows]).any()
    for batch in spies[0].batches:  # the deletion batches keep every context token in the input
        if batch.input_ids.shape[0] and batch is not prepared.batch:
            assert not (batch.reasoning_mask.bool() & ~batch.attention_mask.bool()).any()
    # scores only on reasoning tokens
    resp_ctx = torch.zeros_like(att.reasoning_mask)
    for b, m in enumerate(masks):
        resp_ctx[b, :len(m)] = m == 0
    assert (att.importance[resp_ctx] == 0).all()
    assert (att.importance[att.reasoning_mask] != 0).any()


@pytest.mark.parametrize("mode", MODES)
def test_context_advantages_untouched_and_mass_over_model_tokens(tok, make_lm, mode):
    prompts, responses, masks, names = multi_turn_rows(tok)
    cfg = OARConfig(mode=mode, probe="as_mean", answer_patterns=("answer_is",))
    model = make_lm(torch.float64, vocab=len(tok))
    valid = padded([torch.ones_like(r) for r in responses]).bool()
    model_mask = padded(masks).bool()
    A = torch.tensor([1.3, -0.7, 0.9, -1.1, 0.4], dtype=torch.float32)
    for base in (A[:, None] * model_mask, A[:, None] * valid):  # verl's GRPO (0 on tool tokens), and A everywhere
        out = oar_advantages(model, prompts, responses, base, tok, cfg, model_masks=masks)
        context = valid & ~model_mask
        assert torch.equal(out.advantages[context], base[context])  # bit for bit
        w = out.token_weights.weights
        # Σw over each row's model tokens = its model-token count: the mass stays on the model's tokens
        mass = torch.where(model_mask, w.double(), 0.0).sum(-1)
        assert (mass - model_mask.sum(-1).double()).abs().max() <= 1e-6
        assert (w[context] == 1).all()
        # rows without a span in their final turn keep GRPO's advantage on every token
        for b in (2, 3):
            assert torch.equal(out.advantages[b], base[b])
        # rows with one are reshaped (their weights are not all 1)
        assert (w[0][model_mask[0]] != 1).any() and (w[1][model_mask[1]] != 1).any()
        # Σw = R over each reshaped row's reasoning tokens, all of them the model's
        reshaped = out.token_weights.reshaped
        assert not (reshaped & context).any()
        R = reshaped.sum(-1).double()
        assert (torch.where(reshaped, w.double(), 0.0).sum(-1) - R).abs().max() <= 1e-6


def test_single_turn_masks_change_nothing(tok, make_lm):
    prompts, responses, masks, _ = multi_turn_rows(tok)
    p, r = prompts[-1:] * 2, responses[-1:] * 2
    cfg = OARConfig(mode="perturbation", probe="as_mean", answer_patterns=("answer_is",))
    model = make_lm(torch.float64, vocab=len(tok))
    plain = attribute(model, p, r, tok, cfg, 0)
    ones = attribute(model, p, r, tok, cfg, 0, model_masks=[torch.ones_like(x) for x in r])
    assert torch.equal(plain.importance, ones.importance) and ones.prepared.model_mask is None


def test_model_masks_must_cover_the_response(tok):
    prompts, responses, masks, _ = multi_turn_rows(tok)
    with pytest.raises(ValueError, match="model_masks: row 0"):
        prepare_attribution(prompts, responses, tok, OARConfig(), 0, model_masks=[masks[0][:-1]] + masks[1:])


def test_reference_target_keeps_tool_outputs_as_context(tok):
    prompts, responses, masks, _ = multi_turn_rows(tok)
    cfg = OARConfig(target="reference", answer_patterns=("answer_is",))
    prepared = prepare_attribution(prompts, responses, tok, cfg, 0, ground_truths=["7"] * 5, model_masks=masks)
    ctx = full_context(dataclasses.replace(prepared), masks)
    reasoning = prepared.batch.reasoning_mask
    assert not (reasoning & ctx[:, :reasoning.shape[1]]).any()
    # the head kept is the response up to the last reasoning token: the tool outputs before it stay in the input
    P = prepared.batch.response_start
    for b in (0, 1):
        r = responses[b]
        last = int(prepared.spans.reasoning_mask[b].nonzero().max())
        assert torch.equal(prepared.batch.input_ids[b, P:P + last + 1], r[:last + 1])
    # a prefix reasoning mask (single-turn) rebuilds as before: the reasoning is the head
    ids = torch.tensor([[5, 6, 7, 8]])
    out = build_reference_responses(ids, torch.ones_like(ids), torch.tensor([[True, True, False, False]]), [9], [[3]],
                                    0)
    assert out[0].tolist() == [[5, 6, 9, 3]] and out[2].tolist() == [[True, True, False, False]]


def test_turn_shares():
    valid = torch.ones(2, 6, dtype=torch.bool)
    model = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()
    lay = turn_layout(valid, model)
    w = torch.tensor([[0.5, 0.5, 1.0, 1.0, 1.0, 2.0], [1.0] * 6])
    reasoning = model.clone()
    s = turn_shares(w, reasoning, lay, torch.tensor([True, True]))
    assert s["rows"] == 1  # the single-turn row is not a multi-turn row
    assert s["first"] == pytest.approx(1.0 / 5.0) and s["last"] == pytest.approx(4.0 / 5.0)
    assert s["first_uniform"] == pytest.approx(2 / 5) and s["last_uniform"] == pytest.approx(3 / 5)
    assert torch.isnan(turn_shares(w, reasoning, lay, torch.tensor([False, True]))["first"])
