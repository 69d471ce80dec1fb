"""The math-verify reward: a table of hard cases, the strict GSM8K fast path, and timeouts that never hang.

Every case goes through verl's calling convention (``compute_score(data_source, solution_str, ground_truth, ...)``)
and, like inside verl's reward loop, from a thread other than the main thread (where ``signal.alarm`` cannot work).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify", reason="math-verify is not installed (pip install 'oar-verl[math]')")

from oar_verl.rewards import math_verify_reward as mvr  # noqa: E402

MATH = "DigitalLearningGmbH/MATH-lighteval"
GSM8K = "openai/gsm8k"

# (case id, data_source, response, ground truth, expected score)
CASES = [
    # fractions and decimals
    ("frac-vs-decimal", MATH, r"so the probability is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    ("dfrac-vs-frac12", MATH, r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    ("decimal-vs-frac", MATH, r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("rounded-is-wrong", MATH, r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    # radicals
    ("sqrt-forms", MATH, r"\boxed{3\sqrt{2}}", r"\sqrt{18}", 1.0),
    ("rationalised", MATH, r"$\boxed{\frac{\sqrt{3}}{3}}$", r"\frac{1}{\sqrt{3}}", 1.0),
    ("sqrt-wrong", MATH, r"\boxed{2\sqrt{2}}", r"\sqrt{18}", 0.0),
    # sets, tuples, intervals
    ("set-order", MATH, r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    ("set-wrong", MATH, r"\boxed{\{1,3\}}", r"\{2,1\}", 0.0),
    ("ordered-pair-order-matters", MATH, r"\boxed{(2,1)}", "(1,2)", 0.0),
    ("half-open-interval", MATH, r"\boxed{[1,2)}", "[1,2)", 1.0),
    # thousands separators
    ("thousands-gold", MATH, r"\boxed{1000}", "1,000", 1.0),
    ("thousands-pred", MATH, r"\boxed{1,000}", "1000", 1.0),
    ("thousands-braced-comma", MATH, r"\boxed{1{,}000}", "1000", 1.0),
    # equations, percent, units, symbols
    ("x-equals", MATH, r"\boxed{x=3}", "3", 1.0),
    ("percent-pred", MATH, r"\boxed{10\%}", "10", 1.0),
    ("percent-gold", MATH, r"\boxed{10}", r"10\%", 1.0),
    ("percent-wrong", MATH, r"\boxed{20\%}", "10", 0.0),
    ("text-unit", MATH, r"\boxed{5\text{ cm}}", "5", 1.0),
    ("polynomial", MATH, r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("sign-matters", MATH, r"\boxed{-3}", "3", 0.0),
    ("pi", MATH, r"\boxed{\pi}", r"\pi", 1.0),
    # malformed / missing
    ("no-answer", MATH, "I am not sure.", "5", 0.0),
    ("empty-box", MATH, r"\boxed{}", "5", 0.0),
    ("unclosed-box", MATH, r"\boxed{5", "5", 0.0),
    ("empty-response", MATH, "", "5", 0.0),
    ("garbage-latex", MATH, r"\boxed{\frac{}{}}}}{{", "5", 0.0),
    # GSM8K: strict "#### N" fast path (commas and $ stripped) and the math-verify fallback without "####"
    ("gsm8k-plain", GSM8K, "3 + 4 = 7 bags.\n#### 7", "7", 1.0),
    ("gsm8k-commas", GSM8K, "Total is 1,000 dollars. #### 1,000", "1000", 1.0),
    ("gsm8k-dollar", GSM8K, "#### $72", "72", 1.0),
    ("gsm8k-decimal-equal", GSM8K, "#### 72.00", "72", 1.0),
    ("gsm8k-last-wins", GSM8K, "#### 5\nwait, recount: #### 6", "6", 1.0),
    ("gsm8k-wrong-is-strict", GSM8K, r"#### 8 ... so \boxed{7}", "7", 0.0),
    ("gsm8k-fallback-boxed", GSM8K, r"So she has \boxed{7} apples.", "7", 1.0),
    ("gsm8k-fallback-sentence", GSM8K, "The answer is 72.", "72", 1.0),
    ("gsm8k-missing", GSM8K, "She has some apples.", "7", 0.0),
]


@pytest.fixture(scope="module")
def threads():
    """A thread pool like the one verl's reward loop calls custom rewards from."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool
    mvr.shutdown_pool()


@pytest.mark.parametrize("case_id,data_source,response,truth,expected", CASES, ids=[c[0] for c in CASES])
def test_grading_table(threads, case_id, data_source, response, truth, expected):
    score = threads.submit(mvr.compute_score, data_source, response, truth, extra_info={"index": 0}).result(60)
    assert score == expected, f"{case_id}: {response!r} vs {truth!r} scored {score}, expected {expected}"


@pytest.mark.parametrize("response,truth,expected", [
    ("#### 1,234", "1234", 1.0), ("#### -3", "-3", 1.0), ("#### 3", "-3", 0.0), ("####7", "7", 1.0),
    ("no marker", "7", None), ("#### seven", "7", None), ("#### 7", r"\frac{1}{2}", None),
])
def test_gsm8k_fast_path_decides_without_math_verify(response, truth, expected):
    assert mvr.gsm8k_strict(response, truth) == expected


PATHOLOGICAL = r"The result is \boxed{9^{9^{9^{9^{9}}}}}"  # math-verify without timeouts never returns on this


@pytest.mark.timeout(120)
def test_pathological_answer_returns_zero_within_the_timeout(threads):
    threads.submit(mvr.compute_score, MATH, r"\boxed{1}", "1").result(60)  # pool started: time only the call
    start = time.monotonic()
    score = threads.submit(mvr.compute_score, MATH, PATHOLOGICAL, "1", timeout_s=3).result(60)
    elapsed = time.monotonic() - start
    assert score == 0.0
    assert elapsed < 3 + 1.5, f"took {elapsed:.1f} s with a 3 s timeout"
    # the grader still works afterwards
    assert threads.submit(mvr.compute_score, MATH, r"\boxed{\frac{2}{4}}", "0.5").result(60) == 1.0


@pytest.mark.timeout(120)
def test_outer_timeout_kills_and_replaces_the_pool(threads):
    """An outer timeout shorter than math-verify's own (1 s): the caller gets 0 at once, the pool is replaced."""
    threads.submit(mvr.compute_score, MATH, r"\boxed{1}", "1").result(60)
    old_pool = mvr._pool
    start = time.monotonic()
    assert threads.submit(mvr.compute_score, MATH, PATHOLOGICAL, "1", timeout_s=0.3).result(60) == 0.0
    assert time.monotonic() - start < 0.3 + 1.0
    assert mvr._pool is not old_pool
    assert threads.submit(mvr.compute_score, MATH, r"\boxed{3\sqrt{2}}", r"\sqrt{18}").result(60) == 1.0


def test_loads_by_file_path_like_verl(threads):
    """verl loads custom rewards from a file under a synthetic module name; the pool must still unpickle the worker."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=mvr.__file__, object_name="compute_score")
    assert threads.submit(fn, MATH, r"\boxed{\frac{1}{2}}", "0.5").result(60) == 1.0
    fn_pkg = load_extern_object(module_path="pkg://oar_verl.rewards.math_verify_reward", object_name="compute_score")
    assert fn_pkg is mvr.compute_score
