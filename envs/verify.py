"""Answer extraction and exact comparison for math-style answers.

:func:`extract_answer` takes the final answer out of a response, in this order of
preference: the last ``\\boxed{...}`` (nested braces allowed), the last
``<answer>...</answer>``, a GSM8K-style ``#### X`` line, a final ``answer is X``
phrase, and last of all the last number in the text.

:func:`answers_match` compares exactly: if both sides read as numbers (integers,
decimals, ``a/b``, ``\\frac{a}{b}``, with ``$``, ``%``, thousands commas and a trailing
period ignored) they must be equal as fractions; otherwise the texts must be equal
after case folding and whitespace removal (and ``\\text{}`` unwrapping).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
        j += 1
    return text[i : j - 1].strip() if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer in a response (see the module docstring), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tags = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL | re.IGNORECASE)
    if tags:
        inner = tags[-1].strip()
        boxed = last_boxed(inner)
        return boxed if boxed is not None else inner
    m = re.findall(r"####\s*(.+)", text)
    if m:
        return m[-1].strip()
    m = re.findall(r"answer is[:\s]*\$?\s*([^\n]+?)\s*(?:\.\s*$|$)", text, re.IGNORECASE | re.MULTILINE)
    if m:
        return m[-1].strip()
    nums = _NUMBER_RE.findall(text)
    return nums[-1] if nums else None


def reference_answer(answer: str) -> str:
    """The final answer of a reference solution: the part after ``####`` if present."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    return answer.strip()


#: the longest text `parse_number` reads as a number
MAX_NUMBER_CHARS = 1000


def parse_number(text: str) -> Fraction | None:
    """Read ``text`` as an exact number, or None if it is not one (or if it is longer
    than `MAX_NUMBER_CHARS`: no answer is, and Python refuses to read such integers)."""
    s = text.strip()
    if len(s) > MAX_NUMBER_CHARS:
        return None
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\!", "").replace("{,}", "").replace("\\,", "").strip().rstrip(".").strip()
    m = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    m = re.fullmatch(r"(-?)\\d?frac(\d)(\d)", s)
    if m:
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1) if int(m.group(3)) else None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?\d+)\s*/\s*(\d+)", s)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return Fraction(s)
    return None


def _normalize_text(text: str) -> str:
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    return "".join(text.split()).casefold().rstrip(".")


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether a predicted final answer equals the reference (see the module docstring)."""
    if predicted is None:
        return False
    ref = reference_answer(reference)
    a, b = parse_number(predicted), parse_number(ref)
    if a is not None and b is not None:
        return a == b
    return _normalize_text(predicted) == _normalize_text(ref)


def score_math(response: str, reference: str) -> float:
    """1.0 if the response's final answer matches the reference exactly, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), reference) else 0.0
