"""OpenRLHF's agent path (multi-turn items: environment / tool tokens between the generated turns with action 0) held
to the checks of verl's agent loop (docs/multi_turn.md): the adapter hands the generated tokens to the core as the
model's, so the tool tokens keep their advantages bit for bit, are never scored or weighted, the mass stays on the
generated tokens, and the answer span is the last among the model's own tokens (a span inside a tool output is not
used).

No OpenRLHF here (the adapter's reshape imports none): the items are the replay buffer's as OpenRLHF's agent executor
lays them out, prompt + turns right-padded, ``action_mask`` shifted by one; the model a float64 tiny LM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oar_verl.core.config import OARConfig
from oar_verl.openrlhf.reshape import item_rows, reshape_replay_buffer
from oar_helpers import text_lm

PROMPT = "What is 3 plus 4?"
CALL = " Let me call the calculator: add 3 4."
TOOL = " [tool] 7 [/tool]"
TOOL_SPAN = " [tool] tool says 9. The answer is 9. [/tool]"
FINAL = " So 3 plus 4 is 7. The answer is 7."
NO_SPAN = " So the sum is 7."
LAYOUTS = [  # (text, generated) parts of each response; the last row a single-turn one
    [(CALL, True), (TOOL, False), (FINAL, True)],
    [(CALL, True), (TOOL_SPAN, False), (NO_SPAN, True)],
    [(CALL, True), (TOOL, False), (CALL, True), (TOOL, False), (FINAL, True)],
    [(FINAL, True)],
]
ADVANTAGES = [1.0, -0.5, -0.7, 0.8]


@pytest.fixture(scope="module")
def setup():
    tok, model = text_lm([PROMPT, CALL, TOOL, TOOL_SPAN, FINAL, NO_SPAN] * 40)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    items = []
    for parts, adv in zip(LAYOUTS, ADVANTAGES):
        ids, gen = enc(PROMPT), [False] * len(enc(PROMPT))
        for text, generated in parts:
            ids += enc(text)
            gen += [generated] * len(enc(text))
        ids, gen = ids + [tok.eos_token_id], gen + [True]
        L = len(ids) + 2  # right padding
        seq = torch.full((1, L), tok.pad_token_id)
        seq[0, :len(ids)] = torch.tensor(ids)
        attn = torch.zeros(1, L, dtype=torch.long)
        attn[0, :len(ids)] = 1
        action = torch.zeros(1, L - 1, dtype=torch.bool)  # OpenRLHF's action_mask: token j + 1 generated
        action[0, :len(ids) - 1] = torch.tensor(gen[1:])
        a = adv * action.double()  # OpenRLHF's outcome advantage on the action tokens, 0 elsewhere
        items.append(SimpleNamespace(sequences=seq, action_mask=action, attention_mask=attn, advantages=a,
                                     returns=a.clone(), labels=None))
    return tok, model, items


@pytest.mark.parametrize("mode", ["conservative", "gradient", "perturbation"])
def test_tool_tokens_are_context_on_the_agent_path(setup, mode):
    tok, model, items = setup
    rows = item_rows(items)
    action = rows.action_mask()  # (N, T) the generated tokens of each response, tool outputs in between 0
    valid = torch.arange(action.shape[1])[None, :] < torch.tensor([len(r) for r in rows.responses])[:, None]
    tool = valid & ~action
    assert tool.any(-1).tolist() == [True, True, True, False]
    cfg = OARConfig(mode=mode, probe="as_mean", answer_patterns=("answer_is",))
    res = reshape_replay_buffer([SimpleNamespace(**vars(it)) for it in items], model, tok, cfg, 0, max_tokens=None)
    # the span is the last among the model's own tokens: found on rows 0, 2, 3; row 1's only span is a tool's
    assert res.metrics["oar/span_found_frac"] == pytest.approx(3 / 4)
    assert res.metrics["oar/no_reasoning_seq_frac"] == pytest.approx(1 / 4)
    assert res.metrics["oar/adv_mass_rel_err"] <= 1e-6
    # never scored or gated (outside the adapter's response mask, the generated tokens, their weight is 0 as on
    # padding: Â = w·A keeps the base's 0 there, bit for bit)
    assert (res.importance[tool] == 0).all() and not (res.weights.reshaped & tool).any()
    assert torch.equal(res.advantages[tool], res.base_advantages[tool])
    w = res.weights.weights.double()
    assert (torch.where(action, w, 0.0).sum(-1) - action.sum(-1)).abs().max() <= 1e-6  # mass on generated tokens
    assert (w[1][action[1]] == 1).all()  # no span in its own tokens: GRPO's weights


def test_agent_items_through_the_adapter(setup):
    """The reshaped items, token by token: tool positions untouched, Σ over generated tokens kept, row 1 (a span only
    in a tool output) GRPO's."""
    tok, model, items = setup
    fresh = [SimpleNamespace(**vars(it)) for it in items]
    before = [it.advantages.clone() for it in fresh]
    cfg = OARConfig(mode="gradient", probe="as_mean", answer_patterns=("answer_is",))
    reshape_replay_buffer(fresh, model, tok, cfg, 0, max_tokens=None)
    for i, (it, adv0) in enumerate(zip(fresh, before)):
        action = it.action_mask.bool()
        assert torch.equal(it.advantages[~action], adv0[~action])  # tool tokens (and prompt, padding) bit for bit
        mass = it.advantages[action].double().sum()
        assert abs(float(mass) - ADVANTAGES[i] * int(action.sum())) <= 1e-6 * int(action.sum())
    assert torch.equal(fresh[1].advantages, before[1])  # no span in its own tokens: GRPO's weights
    assert float(fresh[0].advantages[fresh[0].action_mask.bool()].std()) > 0  # reshaped
