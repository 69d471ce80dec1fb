"""The credit task with the decisive token early or in the middle (research/digit_task.py): the reward follows the
named digit and nothing else, the token roles mark that digit, the generated examples are well formed, and ``last``
is the product's own task."""

from __future__ import annotations

import random

import pytest
import torch

from oar_verl.quickstart import last_digit
from research import credit, digit_task
from research.digit_task import TASKS


@pytest.mark.parametrize("name", sorted(TASKS))
def test_examples_are_well_formed_and_scored_by_the_named_digit(name):
    t = TASKS[name]
    rng = random.Random(0)
    for _ in range(200):
        ex = t.make_example(rng)
        assert (ex.n_digits, ex.threshold) in t.PROMPTS and len(ex.digits) == ex.n_digits
        assert ex.prompt == t.prompt_text(ex.n_digits, ex.threshold)
        decisive = ex.digits[t.index - 1]
        assert ex.response.endswith(f"The answer is {decisive}.")
        assert t.reward(ex.response, (ex.n_digits, ex.threshold)) == float(decisive > ex.threshold)


def test_the_reward_by_hand():
    first, middle = TASKS["first"], TASKS["middle"]
    assert first.reward("so8 well2 hmm1 The answer is 8.", (3, 5)) == 1.0
    assert first.reward("so8 well2 hmm1 The answer is 1.", (3, 5)) == 0.0  # the last digit stated: wrong here
    assert first.reward("so4 well9 hmm9 The answer is 4.", (3, 5)) == 0.0  # the first digit not above T
    assert first.reward("so8 well2 The answer is 8.", (3, 5)) == 0.0  # two digits where three were asked
    assert first.reward("so8 well2 hmm1", (3, 5)) == 0.0  # no answer statement
    assert middle.reward("so1 well7 hmm1 The answer is 7.", (3, 6)) == 1.0
    assert middle.reward("so7 well1 hmm7 The answer is 7.", (3, 6)) == 0.0
    # the product's task on the same text: the last digit decides
    assert last_digit.reward("so1 well2 hmm8 The answer is 8.", (3, 5)) == 1.0


def test_token_roles_mark_the_named_digit():
    digits = torch.arange(10, 20)
    responses = torch.tensor([[1, 12, 2, 15, 3, 17, 14, 0], [11, 4, 13, 5, 16, 6, 0, 0]])
    response_mask = torch.tensor([[1] * 8, [1] * 7 + [0]])
    reasoning = torch.tensor([[1] * 6 + [0, 0], [1] * 6 + [0, 0]]).bool()  # digit 14 / 16 beyond: not reasoning
    for name, want in (("first", [[0, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]),
                       ("middle", [[0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]])):
        roles = TASKS[name].token_roles(responses, response_mask, reasoning, digits)
        assert roles["decisive"].int().tolist() == want
        assert not (roles["decisive"] & roles["decoy"]).any()
        assert ((roles["decisive"] | roles["decoy"]) == (torch.isin(responses, digits) & reasoning)).all()
        assert roles["answer"].int().tolist() == [[0] * 6 + [1, 1], [0] * 6 + [1, 0]]


def test_last_is_the_products_task_and_unknown_names_are_refused():
    assert digit_task.task("last") is last_digit
    with pytest.raises(ValueError, match="allowed: last, first, middle"):
        digit_task.task("second")
    with pytest.raises(SystemExit):
        credit.main(["--task", "first", "--verl-check", "--report-only"])
    assert credit.TASK is last_digit  # refused before anything changed
