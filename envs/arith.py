"""Exact arithmetic on expression text: the calculator tool and the Countdown checker.

:func:`evaluate` parses an expression of numbers (integers or decimals), ``+ - * /``,
optional ``**`` and unary minus, and parentheses, and computes it exactly as a
:class:`fractions.Fraction` (decimals are read from their digits, never through
float). Anything else (names, calls, other operators) is rejected with
:class:`ExpressionError` naming the offending part.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 64
MAX_DIGITS = 200

_UNICODE_OPS = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-", "—": "-", "^": "**"})


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression, or cannot be computed."""


def normalize(text: str) -> str:
    """Map common typographic operators to Python ones (``×`` -> ``*``, ``^`` -> ``**``)
    and drop thousands separators inside numbers (``1,234`` -> ``1234``)."""
    text = text.translate(_UNICODE_OPS)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return text.strip()


def evaluate(text: str, *, allow_pow: bool = True, allow_unary: bool = True) -> Fraction:
    """The exact value of ``text`` (after :func:`normalize`)."""
    expr = normalize(text)
    if not expr:
        raise ExpressionError("the expression is empty")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ExpressionError(f"{expr!r} is not a valid arithmetic expression") from None
    return _eval(tree.body, expr, allow_pow, allow_unary)


def numbers_in(text: str) -> list[Fraction]:
    """The number literals of an expression, in order (after :func:`normalize`)."""
    expr = normalize(text)
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ExpressionError(f"{expr!r} is not a valid arithmetic expression") from None
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            out.append(_literal(node, expr))
    return out


def _literal(node: ast.Constant, src: str) -> Fraction:
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
        raise ExpressionError(f"{node.value!r} is not a number")
    segment = ast.get_source_segment(src, node) or repr(node.value)
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", segment):
        raise ExpressionError(f"{segment!r} is not a plain decimal number")
    if len(segment) > MAX_DIGITS:
        raise ExpressionError("a number has too many digits")
    return Fraction(segment)


def _eval(node, src: str, allow_pow: bool, allow_unary: bool) -> Fraction:
    if isinstance(node, ast.Constant):
        return _literal(node, src)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        if not allow_unary:
            raise ExpressionError("unary minus/plus is not allowed here")
        v = _eval(node.operand, src, allow_pow, allow_unary)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a = _eval(node.left, src, allow_pow, allow_unary)
        b = _eval(node.right, src, allow_pow, allow_unary)
        op = node.op
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, ast.Div):
            if b == 0:
                raise ExpressionError("division by zero")
            return a / b
        if isinstance(op, ast.Pow):
            if not allow_pow:
                raise ExpressionError("powers (**) are not allowed here")
            if b.denominator != 1 or abs(b) > MAX_EXPONENT:
                raise ExpressionError(f"exponents must be integers of at most {MAX_EXPONENT}")
            if a == 0 and b < 0:
                raise ExpressionError("division by zero")
            if max(abs(a.numerator), a.denominator).bit_length() * abs(int(b)) > 4096:
                raise ExpressionError("the power is too large")
            return a ** int(b)
        raise ExpressionError(f"the operator {type(op).__name__} is not allowed")
    segment = ast.get_source_segment(src, node) or type(node).__name__
    raise ExpressionError(f"{segment!r} is not allowed: use numbers, + - * /, and parentheses")


def format_number(value: Fraction) -> str:
    """Exact text for ``value``: an integer, a terminating decimal, or ``a/b``."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    twos = fives = 0
    while d % 2 == 0:
        d //= 2
        twos += 1
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value) * 10**places
    digits = str(scaled.numerator).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return ("-" if value < 0 else "") + text
