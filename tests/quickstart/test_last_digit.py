"""The quickstart's last-digit task: its reward, its examples and the token roles the credit study measures."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.quickstart import last_digit as credit_task
from oar_verl.quickstart import last_digit_reward as credit_reward
from oar_verl.quickstart import tiny_lm as task


@pytest.mark.parametrize("text, k, t, want", [
    ("so4 well9 The answer is 9.", 2, 5, 1.0),
    ("so4 well5 The answer is 5.", 2, 5, 0.0),  # last digit not above T
    ("so9 well7 The answer is 9.", 2, 5, 0.0),  # states a decoy, not the last digit
    ("so9 well7 ok8 The answer is 8.", 2, 5, 0.0),  # wrong digit count
    ("so9 well7", 2, 5, 0.0),  # no answer
    ("so1 The answer is 3. well7 The answer is 7.", 2, 5, 0.0),  # the last statement counts: 3 digits before it
    ("", 2, 5, 0.0),
])
def test_reward(text, k, t, want):
    assert credit_reward.score_response(text, k, t) == want
    assert credit_reward.compute_score("last_digit", text, f"{k},{t}") == want


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_examples_are_correct_exactly_when_the_last_digit_is_above_the_threshold(seed):
    ex = credit_task.make_example(random.Random(seed))
    assert len(ex.digits) == ex.n_digits and ex.prompt == credit_task.prompt_text(ex.n_digits, ex.threshold)
    assert credit_task.reward(ex.response, (ex.n_digits, ex.threshold)) == float(ex.digits[-1] > ex.threshold)


def test_token_roles(tmp_path):
    from oar_verl.core.text.spans import locate_answer_spans

    examples = credit_task.make_examples(300, "tok")
    task.build_tokenizer(tmp_path, examples)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    part = credit_task.make_examples(32, "roles")
    b = task.verl_batch(*task.encode(tok, part), tok.pad_token_id)
    spans = locate_answer_spans(b.responses, b.response_mask, tok, ("answer_is",))
    assert bool(spans.found.all())
    roles = credit_task.token_roles(b.responses, b.response_mask, spans.reasoning_mask,
                                    credit_task.digit_token_ids(tok))
    valid = b.response_mask.bool()
    # the four roles partition the valid response tokens
    total = sum(m.int() for m in roles.values())
    assert torch.equal(total, valid.int())
    for i, ex in enumerate(part):
        dec = b.responses[i][roles["decisive"][i]]
        assert dec.tolist() == [tok.convert_tokens_to_ids(str(ex.digits[-1]))]
        assert int(roles["decoy"][i].sum()) == ex.n_digits - 1
        assert tok.decode(b.responses[i][roles["answer"][i]], skip_special_tokens=True).strip() == \
            f"The answer is {ex.digits[-1]}."
