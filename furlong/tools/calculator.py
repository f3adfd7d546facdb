"""The calculator tool: arithmetic expressions evaluated safely, with bounded sizes.

The expression is parsed with `ast` (mode "eval") and walked: only number literals (int, float; no
bool, str or complex), + - * / // % **, unary + -, and parentheses (which the parser folds into the
tree) are accepted; anything else (names, calls, attributes, subscripts, comparisons, ...) is an
error, so nothing of the host is ever reached: no eval, no exec. Bounds keep one call cheap:

  MAX_CHARS   characters of the expression
  MAX_DEPTH   nesting depth of the tree
  MAX_DIGITS  digits of any integer, literal or intermediate (checked before a product or power
              is computed: the result's digit count is bounded by the operands' sums/products)
  MAX_EXPONENT  |exponent| of **

Results: an int prints exactly; a float that is a whole number prints as an int, others with up to
12 significant digits. Every failure is a CalculatorError whose message the tool returns to the
model ("error: ...") instead of a result.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_DIGITS = 100
MAX_EXPONENT = 256

SPEC = {   # the tool's OpenAI-style function spec (the chat template's tools=[...])
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "e.g. 12345 * 6789"}}, "required": ["expression"]},
    },
}


class CalculatorError(ValueError):
    pass


def _digits(x: int) -> int:
    return len(str(abs(x))) if abs(x) < 10 ** 18 else int(math.log10(abs(x))) + 1


def _check_int(x: int | float) -> int | float:
    if isinstance(x, int) and _digits(x) > MAX_DIGITS:
        raise CalculatorError(f"number longer than {MAX_DIGITS} digits")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("result is not finite")
    return x


def _mul(a: int | float, b: int | float) -> int | float:
    if isinstance(a, int) and isinstance(b, int) and a and b and _digits(a) + _digits(b) - 1 > MAX_DIGITS:
        raise CalculatorError(f"product longer than {MAX_DIGITS} digits")
    return a * b


def _pow(a: int | float, b: int | float) -> int | float:
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent beyond +-{MAX_EXPONENT}")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and (_digits(a) - 1) * b >= MAX_DIGITS:
        raise CalculatorError(f"power longer than {MAX_DIGITS} digits")
    if a == 0 and b < 0:
        raise CalculatorError("division by zero")
    try:
        return a ** b
    except OverflowError:
        raise CalculatorError("result too large") from None


def _div(op):
    def run(a: int | float, b: int | float) -> int | float:
        if b == 0:
            raise CalculatorError("division by zero")
        return op(a, b)
    return run


BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul, ast.Div: _div(operator.truediv),
          ast.FloorDiv: _div(operator.floordiv), ast.Mod: _div(operator.mod), ast.Pow: _pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_int(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        return _check_int(BINARY[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand, depth + 1))
    raise CalculatorError(f"unsupported element {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (module docstring), or CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError("not an arithmetic expression") from None
    except RecursionError:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH}") from None
    return _eval(tree.body, 0)


def format_result(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator(expression: str) -> str:
    """The tool: the result as text, or "error: why"."""
    try:
        return format_result(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"
