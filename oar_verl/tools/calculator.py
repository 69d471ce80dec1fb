"""A calculator for verl's tool agent loop: a ``BaseTool`` (``verl.tools.base_tool``) that evaluates one arithmetic
expression (numbers, ``+ - * / // % **``, parentheses) and returns its value as text; what the GSM8K tool recipes
(``recipes/gsm8k/oar_tools_*.sh``, ``recipes/tools/calculator.yaml``) and the CPU multi-turn end-to-end run give the
policy (docs/multi_turn.md).

Loaded by verl from its tool config: ``class_name: oar_verl.tools.calculator.CalculatorTool``, ``config.type:
native``; the schema names one string argument, ``expr`` (a JSON number is taken as that number).

The tool's output text is only ever a number (``68``, ``3.5``: an integral value without ``.0``, other floats rounded
to 6 decimals, a float past 2**53 as its 15 significant digits, ``3.33333333333333e+99``) or ``error: <reason>``
from a fixed list of reasons: it never echoes the model's text back, so a tool output never holds text the model did
not compute. Nothing raises (parse, evaluation and formatting included), and the work is bounded, so no expression
can stall verl's agent loop:

- the expression: at most ``MAX_CHARS`` (200) characters; after thousands commas are stripped, only digits, ``.``,
  ``e``/``E``, ``_``, ``+ - * / % ( )`` and blanks; its syntax tree at most ``MAX_DEPTH`` (64) levels deep and
  ``MAX_NODES`` (256) nodes;
- every number, literal, operand and intermediate result: real, finite, ``|value| <= LIMIT`` (``10**MAX_DIGITS``,
  ``10**100``); ``a * b`` on integers and ``a ** b`` are refused from their operands' sizes (bit lengths,
  ``b * log10|a|``) before anything is computed, so no operation ever builds a number above about ``LIMIT**2``;
- ``execute`` evaluates in a worker thread (``asyncio.to_thread``) under ``asyncio.wait_for(..., TIMEOUT_S)`` (5 s)
  and answers ``error: timed out`` past it; with the bounds above one evaluation takes a few milliseconds at most
  (measured on CPU), so the limit is only a backstop.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorTool", "SCHEMA", "evaluate"]

SCHEMA = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression, e.g. 23+45 or (12*3)/4.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "the expression"}},
                   "required": ["expr"]}}}

MAX_CHARS = 200  # longer expressions are refused
MAX_DEPTH = 64  # syntax-tree levels (parentheses, unary signs, operators)
MAX_NODES = 256  # syntax-tree nodes
MAX_DIGITS = 100
LIMIT = 10**MAX_DIGITS  # |every number| <= LIMIT
TIMEOUT_S = 5.0  # execute's backstop: the evaluation's wall-clock limit
DECIMALS = 6  # floats are rounded to this many decimals

_LIMIT_BITS = LIMIT.bit_length()
_ALLOWED = frozenset("0123456789.eE_+-*/%() \t")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

# the fixed reasons: the only texts after "error: " the tool ever returns
NOT_TEXT = "expr must be a string holding an arithmetic expression"
NO_EXPR = "the arguments must be an object with a string field expr"
TOO_LONG = f"expression longer than {MAX_CHARS} characters"
BAD_CHARS = "only numbers, + - * / // % ** and parentheses are allowed"
TOO_DEEP = f"expression nested deeper than {MAX_DEPTH} levels or longer than {MAX_NODES} terms"
SYNTAX = "not a valid arithmetic expression"
UNSUPPORTED = "unsupported syntax: only numbers, + - * / // % ** and parentheses are allowed"
ZERO_DIVISION = "division by zero"
TOO_LARGE = f"a number above 10**{MAX_DIGITS} in magnitude"
NOT_FINITE = "a result that is not a finite number"
NOT_REAL = "a result that is not a real number"
TIMED_OUT = "timed out"
FAILED = "could not evaluate the expression"


class _Refused(Exception):
    """An expression the calculator refuses; ``reason`` is one of the fixed reasons above."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def evaluate(expr: Any) -> str:
    """The value of ``expr`` as text (an integer without ``.0``, a float rounded to 6 decimals), or ``error: <one of
    the fixed reasons>``. Never raises; the work is bounded (module docstring)."""
    try:
        return _format(_checked(_value_of(expr)))
    except _Refused as e:
        return f"error: {e.reason}"
    except ZeroDivisionError:
        return f"error: {ZERO_DIVISION}"
    except OverflowError:
        return f"error: {TOO_LARGE}"
    except Exception:  # noqa: BLE001 - the tool's contract: every input gets text back, never an exception
        return f"error: {FAILED}"


def _value_of(expr: Any) -> int | float:
    if isinstance(expr, (int, float)) and not isinstance(expr, bool):  # a JSON number for expr
        return expr
    if not isinstance(expr, str):
        raise _Refused(NOT_TEXT)
    if len(expr) > MAX_CHARS:
        raise _Refused(TOO_LONG)
    text = expr.replace(",", "").strip()  # thousands separators: 1,000 → 1000
    if not text or not _ALLOWED.issuperset(text):
        raise _Refused(BAD_CHARS if text else SYNTAX)
    depth = level = 0
    for ch in text:  # parentheses nesting before ast.parse sees it
        level += (ch == "(") - (ch == ")")
        depth = max(depth, level)
    if depth > MAX_DEPTH:
        raise _Refused(TOO_DEEP)
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        raise _Refused(SYNTAX) from None
    _check_shape(tree)
    return _eval(tree)


def _check_shape(tree: ast.AST) -> None:
    """Refuse a syntax tree deeper than MAX_DEPTH or larger than MAX_NODES (iteratively: no recursion)."""
    stack, nodes = [(tree, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH or nodes > MAX_NODES:
            raise _Refused(TOO_DEEP)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _checked(node.value)
        raise _Refused(UNSUPPORTED)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _precheck(node.op, left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise _Refused(UNSUPPORTED)


def _precheck(op: ast.operator, a: int | float, b: int | float) -> None:
    """Refuse ``a * b`` (integers) and ``a ** b`` whose result would exceed LIMIT, from the operands' sizes alone.
    Conservative: what passes is computed and checked exactly; ``a``, ``b`` are already within LIMIT."""
    if isinstance(op, ast.Mult) and isinstance(a, int) and isinstance(b, int) and a and b:
        if a.bit_length() + b.bit_length() - 1 > _LIMIT_BITS:  # |a*b| >= 2**(bits(a)+bits(b)-2)
            raise _Refused(TOO_LARGE)
    if isinstance(op, ast.Pow) and a != 0 and b != 0:
        if b * math.log10(abs(a)) > MAX_DIGITS + 1:  # log10|a**b|; |a| <= 1e100, |b| <= 1e100: no overflow
            raise _Refused(TOO_LARGE)


def _checked(value: Any) -> int | float:
    """``value`` if it is a real, finite number within LIMIT; otherwise the reason it is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Refused(NOT_REAL)
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused(NOT_FINITE)
    if abs(value) > (float(LIMIT) if isinstance(value, float) else LIMIT):  # 1e100 is float(LIMIT), just above it
        raise _Refused(TOO_LARGE)
    return value


def _format(value: int | float) -> str:
    """An integral value without ``.0``; other floats rounded to DECIMALS, in exponent notation only past 2**53 (15
    significant digits: float holds no more)."""
    if isinstance(value, float):
        if abs(value) >= 2.0 ** 53:  # past float's exact integers: its 15 significant digits, not binary noise
            return f"{value:.15g}"
        value = round(value, DECIMALS)
        if value.is_integer():
            value = int(value)
    if isinstance(value, int):
        return str(value)
    text = repr(value)
    return f"{value:.{DECIMALS}f}".rstrip("0") if "e" in text else text  # 1e-05 → 0.00001


class CalculatorTool(BaseTool):
    """verl ``BaseTool``: ``{"name": "calc", "arguments": {"expr": "23+45"}}`` → ``68``. Stateless: no instance state,
    no reward of its own (the task's reward scores the final answer). ``timeout_s``: the evaluation's backstop."""

    timeout_s: float = TIMEOUT_S

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Evaluate ``parameters["expr"]`` in a worker thread, off verl's event loop; never raises."""
        try:
            if not isinstance(parameters, dict) or "expr" not in parameters:
                text = f"error: {NO_EXPR}"
            else:
                text = await asyncio.wait_for(asyncio.to_thread(evaluate, parameters["expr"]), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            text = f"error: {TIMED_OUT}"
        except Exception:  # noqa: BLE001 - e.g. no thread could start: still text, never an exception
            text = f"error: {FAILED}"
        return ToolResponse(text=text), 0.0, {}
