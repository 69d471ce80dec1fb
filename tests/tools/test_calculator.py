"""The GSM8K recipes' calculator tool (``oar_verl.tools.calculator``): ordinary arithmetic, hostile expressions that
must come back as text (a number or ``error: <fixed reason>``) without ever raising or stalling the event loop, and a
property test against Python's own evaluation.

The real ``CalculatorTool`` (a verl 0.9.1 ``BaseTool``) is driven through asyncio the way verl's ``ToolAgentLoop``
awaits it (``await tool.execute(instance_id, tool_args, agent_data=...)``).
"""

from __future__ import annotations

import asyncio
import math
import operator
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl.tools.schemas import ToolResponse

from oar_verl.tools import calculator as calc
from oar_verl.tools.calculator import CalculatorTool, evaluate

pytestmark = pytest.mark.timeout(300)  # a hang guard (a regression would stall, not fail), not a timing check

NUMBER = re.compile(r"-?\d+(\.\d+)?(e[+-]\d+)?")  # exponent form only past 2**53 (15 significant digits)
REASONS = {calc.NOT_TEXT, calc.NO_EXPR, calc.TOO_LONG, calc.BAD_CHARS, calc.TOO_DEEP, calc.SYNTAX, calc.UNSUPPORTED,
           calc.ZERO_DIVISION, calc.TOO_LARGE, calc.NOT_FINITE, calc.NOT_REAL, calc.TIMED_OUT, calc.FAILED}


def run_tool(parameters, tool: CalculatorTool | None = None) -> str:
    """The text verl's agent loop reads back from one call, checked to be the tool's only two shapes."""
    tool = tool or CalculatorTool({"type": "native"})
    response, reward, metrics = asyncio.run(tool.execute("instance", parameters, agent_data=None))
    assert isinstance(response, ToolResponse) and reward == 0.0 and metrics == {}
    assert_shape(response.text)
    return response.text


def assert_shape(text: object) -> None:
    """A number, or ``error: `` and one of the fixed reasons (never the model's own text)."""
    assert isinstance(text, str)
    assert NUMBER.fullmatch(text) or (text.startswith("error: ") and text[len("error: "):] in REASONS), text


ORDINARY = [("23+45", "68"), ("7/2", "3.5"), ("(12*3)//5", "7"), ("1,000 + 2", "1002"), ("2**3", "8"),
            ("10/4*2", "5"), ("0.1+0.2", "0.3"), ("1/3", "0.333333"), ("2/3", "0.666667"), ("-7//2", "-4"),
            ("7 % 3", "1"), ("2**0.5", "1.414214"), ("1/100000", "0.00001"), ("-1/100000", "-0.00001"),
            ("1.5e3", "1500"), ("  12 * 3 ", "36"), ("2**-1", "0.5"), ("1e-7", "0"), ("2**-1074", "0"),
            ("1.05**30", "4.321942"), ("10**100", "1" + "0" * 100), ("-(10**100)", "-1" + "0" * 100),
            ("3.0", "3"), ("0.5*4", "2"), ("1_000*2", "2000"), ("(1)", "1"), ("+-+3", "-3")]


@pytest.mark.parametrize(("expr", "expected"), ORDINARY)
def test_ordinary_expressions(expr, expected):
    assert evaluate(expr) == expected
    assert run_tool({"expr": expr}) == expected


def test_a_json_number_for_expr_is_that_number():
    assert run_tool({"expr": 23}) == "23" and run_tool({"expr": 2.5}) == "2.5" and run_tool({"expr": 4.0}) == "4"


HOSTILE = {
    "tower": "9**9**9",
    "power of a power": "(10**60)**60",
    "capped exponents": "((9**64)**64)**64",
    "product chain": "*".join(["10**64"] * 28),  # 195 characters, under the length limit
    "product chain, no spaces": "10**64*10**64*10**64",
    "long product of pows": "*".join(["9**99"] * 33),
    "float overflow": "1e308*10",
    "float literal overflow": "1e999",
    "inf by division": "1/2**-1074",
    "huge literal": "9" * 150,
    "above the limit by one": "10**100+1",
    "division by zero": "1/0",
    "modulo by zero": "5 % 0.0",
    "zero to a negative power": "0**-1",
    "complex result": "(-8)**(1/3)",
    "complex literal": "1j",
    "deep parentheses": "(" * 10_000 + "1" + ")" * 10_000,
    "parentheses under the length limit": "(" * 99 + "1" + ")" * 99,
    "unary chain": "-" * 199 + "1",
    "100 kB": "1+" * 50_000 + "1",
    "bool": "True+1",
    "import": "__import__('os')",
    "attribute": "(1).__class__",
    "call": "abs(-1)",
    "name": "x+1",
    "string constant": "'72'",
    "comparison": "1<2",
    "shift": "1<<10**9",
    "answer marker": "#### 72",
    "answer after an expression": "1+1 #### 72",
    "empty": "",
    "blank": "   ",
    "syntax": "1+",
    "null byte": "1\x00",
    "lambda": "lambda: 1",
}
MUST_FAIL = set(HOSTILE) - {"parentheses under the length limit", "unary chain"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_expressions_come_back_as_text(name):
    expr = HOSTILE[name]
    direct = evaluate(expr)
    assert_shape(direct)
    assert run_tool({"expr": expr}) == direct
    if name in MUST_FAIL:
        assert direct.startswith("error: ")
    assert "72" not in direct  # a tool output never holds text the model did not compute


@pytest.mark.parametrize("parameters", [["1+1"], "1+1", None, 7, {}, {"wrong": 1}, {"expr": None}, {"expr": ["1"]},
                                        {"expr": True}, {"expr": {"a": 1}}, {"expr": 10**5000},
                                        {"expr": float("nan")}, {"expr": float("inf")}],
                         ids=["list", "str", "none", "int", "empty", "missing", "expr-none", "expr-list", "expr-bool",
                              "expr-dict", "expr-huge-int", "expr-nan", "expr-inf"])
def test_bad_arguments_come_back_as_errors(parameters):
    assert run_tool(parameters).startswith("error: ")


def test_past_the_time_limit_execute_answers_timed_out():
    tool = CalculatorTool({"type": "native"})
    tool.timeout_s = 0  # the backstop fires before the worker thread answers
    assert run_tool({"expr": "1+1"}, tool) == f"error: {calc.TIMED_OUT}"


WORST = [HOSTILE["product chain"], HOSTILE["long product of pows"], HOSTILE["tower"], "+".join(["9**104"] * 28),
         "*".join(["(10**50-1)"] * 18)]


@pytest.mark.parametrize("expr", WORST, ids=["10**64 chain", "9**99 chain", "tower", "sum of 9**104", "near-limit"])
def test_the_event_loop_keeps_running_while_execute_evaluates(expr):
    """A ticker task on verl's loop makes progress while ``execute`` is in flight: the evaluation runs off the loop
    (an evaluation on the loop itself would return before the ticker ever ran)."""

    async def main():
        ticks, done = 0, False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker has started
        before = ticks
        response, _, _ = await CalculatorTool({"type": "native"}).execute("i", {"expr": expr}, agent_data=None)
        during = ticks - before  # awaited directly, as verl does: the ticker only runs if execute yields the loop
        done = True
        await task
        return response.text, during

    text, during = asyncio.run(main())
    assert during >= 1
    assert text == evaluate(expr)
    assert_shape(text)


# --- property: random small expressions against Python's own evaluation ---------------------------------------------

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
        "%": operator.mod}


def _within(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (not isinstance(value, float) or math.isfinite(value))
            and abs(value) <= (float(calc.LIMIT) if isinstance(value, float) else calc.LIMIT))


def _apply(fn, a, b):
    """(value, within bounds) of Python's ``fn(a, b)``; a refusal by Python itself is out of bounds."""
    try:
        value = fn(a, b)
    except (ZeroDivisionError, OverflowError):
        return None, False
    return value, _within(value)


leaves = st.one_of(st.integers(0, 10**6), st.integers(0, 12),
                   st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.5, 0.1, 1e-7, 1e15, 1e99, 10**99, 1.0])).map(lambda v: (repr(v), v, True))


def _extend(children):
    """(text, Python's value, every step within bounds) of a negation, a binary operation or a small power."""
    binary = st.tuples(children, st.sampled_from(sorted(_OPS)), children).map(
        lambda t: (f"({t[0][0]}){t[1]}({t[2][0]})",) + _combine(_OPS[t[1]], t[0], t[2]))
    power = st.tuples(children, st.sampled_from([-3, -1, 0, 1, 2, 3, 5, 0.5])).map(
        lambda t: (f"({t[0][0]})**({t[1]!r})",) + _combine(operator.pow, t[0], (repr(t[1]), t[1], True)))
    negation = children.map(lambda c: (f"-({c[0]})", -c[1] if c[2] else None, c[2]))
    return st.one_of(binary, power, negation)


def _combine(fn, left, right):
    if not (left[2] and right[2]):
        return None, False
    return _apply(fn, left[1], right[1])


expressions = st.recursive(leaves, _extend, max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expressions)
def test_small_expressions_match_python(case):
    text, value, within = case
    result = evaluate(text)
    assert_shape(result)
    if not (within and len(text) <= calc.MAX_CHARS):
        assert result.startswith("error: ")
        return
    assert eval(text) == value  # noqa: S307 - Python's own evaluation of the generated arithmetic
    if isinstance(value, int):
        assert result == str(value)
    else:
        assert math.isclose(float(result), value, rel_tol=1e-12, abs_tol=5.1e-7), (text, result, value)
        if abs(value) >= 2.0 ** 53:  # past float's exact integers: 15 significant digits
            assert result == f"{value:.15g}"
        else:
            assert ("." in result) == (not round(value, calc.DECIMALS).is_integer())


def test_large_floats_print_their_significant_digits_and_floats_reach_the_bound():
    """A float past 2**53 prints its 15 significant digits, not binary noise; 1e100 (float's nearest to the bound,
    just above 10**100) is within it."""
    assert evaluate("10**100/3") == "3.33333333333333e+99"
    assert evaluate("1e100-1e84") == "1e+100"
    assert evaluate("1e100*10").startswith("error: ")
