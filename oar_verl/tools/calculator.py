"""A calculator for verl's tool agent loop: a ``BaseTool`` (``verl.tools.base_tool``) that evaluates one arithmetic
expression (numbers, ``+ - * / // % **``, parentheses) and returns its value as text; what the GSM8K tool recipes
(``recipes/gsm8k/oar_tools_*.sh``, ``recipes/tools/calculator.yaml``) and the CPU multi-turn end-to-end run give the
policy (docs/multi_turn.md).

Loaded by verl from its tool config: ``class_name: oar_verl.tools.calculator.CalculatorTool``, ``config.type:
native``; the schema names one string argument, ``expr``. A bad expression returns an error text (the model reads it
as the tool's output), never raises.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorTool", "SCHEMA", "evaluate"]

SCHEMA = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression, e.g. 23+45 or (12*3)/4.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "the expression"}},
                   "required": ["expr"]}}}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_CHARS = 200  # longer expressions are refused
MAX_EXPONENT = 64  # 2**64 at most: no expression runs long


def evaluate(expr: str) -> str:
    """The value of ``expr`` as text (an integer without ``.0``), or ``error: ...``."""
    try:
        if len(expr) > MAX_CHARS:
            raise ValueError(f"longer than {MAX_CHARS} characters")
        value = _eval(ast.parse(expr.replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


class CalculatorTool(BaseTool):
    """verl ``BaseTool``: ``{"name": "calc", "arguments": {"expr": "23+45"}}`` → ``68``. Stateless: no instance state,
    no reward of its own (the task's reward scores the final answer)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expr = parameters.get("expr", "") if isinstance(parameters, dict) else ""
        return ToolResponse(text=evaluate(str(expr))), 0.0, {}
