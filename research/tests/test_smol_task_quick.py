"""The SmolLM2 learning task (research/smol_task.py): the generator on fixed seeds, the strict verifier, the intervals,
the choice rule and the committed base-rate measurement it must agree with (its kept responses re-verified). No
model or tokenizer is loaded: the GGUF tokenizer alone takes ~30 s here; the measurement itself ran the chat format
through it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from research import smol_task as st


def _evaluate(question: str) -> int:
    expr = re.fullmatch(r"What is ([\d +-]+)\? .*", question).group(1).split()
    acc = int(expr[0])
    for op, n in zip(expr[1::2], expr[2::2]):
        acc = acc + int(n) if op == "+" else acc - int(n)
    return acc


@pytest.mark.parametrize("name", list(st.SETTINGS))
def test_problems_are_fixed_correct_and_solved_by_their_own_solution(name):
    s = st.SETTINGS[name]
    ps = st.problems(s, 40)
    assert ps == st.problems(s, 40)  # the same list every time
    assert ps != st.problems(s, 40, seed=1)
    for p in ps:
        assert p.answer == _evaluate(p.question) >= 0
        nums = [int(x) for x in re.findall(r"\d+", p.question.split("?")[0])]
        assert len(nums) == s.terms and all(s.lo <= n <= s.hi for n in nums)
        lines = p.solution.split("\n")
        assert len(lines) == s.terms  # one line per operation, then the answer line
        assert all(int(line.split("= ")[1]) >= 0 for line in lines[:-1])
        assert st.verify(p.solution, p.answer) == 1.0
        assert st.verify(p.solution, p.answer + 1) == 0.0


def test_examples_never_among_the_measured_problems_and_precede_the_question():
    s = st.SETTINGS["add_sub_1digit_3shot"]
    p = st.problems(s, 1)[0]
    chat = st.messages(s, p)
    assert [t["role"] for t in chat] == ["user", "assistant"] * 3 + ["user"]
    assert chat[-1]["content"] == p.question
    shots = st.problems(s, 3, seed=st.EXAMPLE_SEED)
    assert [t["content"] for t in chat[1:-1:2]] == [x.solution for x in shots]
    assert st.messages(st.SETTINGS["add_sub_1digit_1shot"], p)[-1]["content"] == p.question


@pytest.mark.parametrize("response,answer,reward", [
    ("3 + 4 = 7\n7 - 2 = 5\nThe answer is 5.", 5, 1.0),
    ("the answer is 5", 5, 1.0),
    ("The answer is 5!<|im_end|>\nThe answer is 6.", 5, 1.0),  # cut at the end of turn
    ("The answer is 4. Wait, no: the answer is 5.", 5, 1.0),  # the last one is the final answer
    ("The answer is 5. Wait, no: the answer is 4.", 5, 0.0),
    ("3 + 4 = 7\n7 - 2 = 5", 5, 0.0),  # no final-answer sentence: no fallback to the last number
    ("The answer is N.", 5, 0.0),
    ("The answer is 5.5", 5, 0.0),  # a decimal is not the integer 5
    ("The answer is 55.", 5, 0.0),
    ("The answer is 5,000.", 5, 0.0),
    ("The answer is -5.", -5, 1.0),
    ("The answer is: 5.", 5, 0.0),  # the strict format only
])
def test_verifier_is_strict(response, answer, reward):
    assert st.verify(response, answer) == reward


def test_setting_rejects_bad_fields():
    with pytest.raises(ValueError, match="ops"):
        st.Setting("x", terms=3, lo=1, hi=9, ops="*", shots=1)
    with pytest.raises(ValueError, match="terms"):
        st.Setting("x", terms=1, lo=1, hi=9, ops="+", shots=1)


def test_intervals():
    lo, hi = st.wilson(50, 200)
    assert lo < 0.25 < hi and 0.18 < lo and hi < 0.32
    assert st.wilson(0, 10)[0] == 0.0 and st.wilson(10, 10)[1] == pytest.approx(1.0)
    r = np.random.default_rng(0).random((64, 4)) < 0.4
    lo, hi = st.clustered_bootstrap(r)
    assert lo < r.mean() < hi
    same = np.repeat(r[:, :1], 4, axis=1)  # samples identical within a prompt: the clustered interval is wider
    assert np.diff(st.clustered_bootstrap(same)) > np.diff(st.wilson(int(same.sum()), same.size)) * 0.9
    with pytest.raises(ValueError, match="rewards"):
        st.clustered_bootstrap(np.zeros(5))


def _run(name, rate, ci, prompts=64, completions=256):
    return {"setting": {"name": name}, "rate": rate, "clustered95": ci, "prompts": prompts,
            "completions": completions}


def test_choose_rule():
    runs = [_run("a", 0.1, [0.05, 0.15]), _run("b", 0.3, [0.22, 0.38]), _run("c", 0.45, [0.35, 0.55]),
            _run("d", 0.4, [0.1, 0.7]), _run("e", 0.4, [0.3, 0.5], prompts=16, completions=32)]
    assert st.choose(runs) == "c"  # inside, closest to 0.4; d straddles the bounds; e is screening only
    assert st.choose(runs[:1]) is None


def test_committed_measurement_agrees_with_the_module():
    rec = json.loads(st.RESULTS.read_text())
    assert rec["chosen"] == st.CHOSEN == st.choose(rec["runs"])
    assert all(r["setting"]["name"] in st.SETTINGS for r in rec["runs"])  # every setting tried is still defined
    for r in rec["runs"]:
        assert r["command"].startswith("python -m research.smol_task")
        assert r["setting"] == {k: getattr(st.SETTINGS[r["setting"]["name"]], k) for k in r["setting"]}
    for r in rec["runs"]:  # the verifier, re-run on the model's own responses kept in the file, gives their rewards
        assert r["examples"] and all(st.verify(x["response"], x["answer"]) == x["reward"] for x in r["examples"])
    full = [r for r in rec["runs"] if r["setting"]["name"] == st.CHOSEN and r["completions"] >= 200]
    assert full and all(st.TARGET[0] <= r["clustered95"][0] and r["clustered95"][1] <= st.TARGET[1] for r in full)
