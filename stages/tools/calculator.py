"""Safe arithmetic: an expression is parsed with `ast` and evaluated node by node; only numbers
(int, float), parentheses, unary + and -, and + - * / // % ** are accepted. Names, calls,
attributes, strings and everything else are refused before anything is evaluated, and the sizes
that could exhaust the machine are bounded (expression length, nesting, exponent, integer bits).
"""
from __future__ import annotations

import ast
import dataclasses
import math
import operator


class CalculatorError(ValueError):
    """The expression is refused or cannot be evaluated (the message says why)."""


@dataclasses.dataclass(frozen=True)
class CalculatorLimits:
    max_length: int = 500        # characters of the expression
    max_depth: int = 50          # nesting of operations
    max_exponent: int = 1000     # |exponent| of an integer power
    max_int_bits: int = 4096     # bits of any integer result (about 1233 decimal digits)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def evaluate(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> int | float:
    """The value of an arithmetic expression, or CalculatorError saying why not."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > limits.max_length:
        raise CalculatorError(f"the expression has {len(text)} characters, more than {limits.max_length}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {getattr(exc, 'msg', exc)}") from None
    _check(tree.body, limits, 0)  # refuse the whole expression before evaluating any of it
    try:
        return _eval(tree.body, limits)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def _check(node: ast.AST, limits: CalculatorLimits, depth: int) -> None:
    if depth > limits.max_depth:
        raise CalculatorError(f"the expression nests deeper than {limits.max_depth}")
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, limits, depth + 1)
        _check(node.right, limits, depth + 1)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, limits, depth + 1)
    else:
        raise CalculatorError(f"only numbers and + - * / // % ** are allowed, found {_describe(node)}")


def _describe(node: ast.AST) -> str:
    kinds = {ast.Call: "a call", ast.Name: "a name", ast.Attribute: "an attribute", ast.Subscript: "a subscript",
             ast.Lambda: "a lambda", ast.Compare: "a comparison", ast.BoolOp: "a boolean operator"}
    what = next((label for cls, label in kinds.items() if isinstance(node, cls)), type(node).__name__)
    try:
        return f"{what} ({ast.unparse(node)[:60]})"
    except Exception:  # noqa: BLE001 - describing is best effort
        return what


def _eval(node: ast.AST, limits: CalculatorLimits) -> int | float:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, limits))
    left, right = _eval(node.left, limits), _eval(node.right, limits)
    op = type(node.op)
    if isinstance(left, int) and isinstance(right, int):
        if op is ast.Pow:
            if abs(right) > limits.max_exponent:
                raise CalculatorError(f"the exponent {right} is larger than {limits.max_exponent} in magnitude")
            if right > 0 and max(1, abs(left).bit_length()) * right > limits.max_int_bits + right:
                raise CalculatorError(f"the result would exceed {limits.max_int_bits} bits")
        elif op is ast.Mult and abs(left).bit_length() + abs(right).bit_length() > limits.max_int_bits + 1:
            raise CalculatorError(f"the result would exceed {limits.max_int_bits} bits")
    elif op is ast.Pow and isinstance(right, (int, float)) and abs(right) > limits.max_exponent:
        raise CalculatorError(f"the exponent {right} is larger than {limits.max_exponent} in magnitude")
    result = _BINARY[op](left, right)
    if isinstance(result, complex):
        raise CalculatorError(f"the result of {_SYMBOL[op]} is not a real number")
    if isinstance(result, float) and not math.isfinite(result):
        raise CalculatorError("the result is not a finite number")
    if isinstance(result, int) and result.bit_length() > limits.max_int_bits:
        raise CalculatorError(f"the result would exceed {limits.max_int_bits} bits")
    return result


def format_number(value: int | float) -> str:
    """How a result is written back to the model: integers exactly, floats by repr."""
    return str(value) if isinstance(value, int) else repr(value)
