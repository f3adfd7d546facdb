"""Normalization and the non-symbolic comparisons of the `math` reward (rules in math_reward).

`normalize` strips presentation (LaTeX wrappers, currency, percent, thousands
commas, spacing) and rewrites the TeX shorthand `\\frac34` as `\\frac{3}{4}` so a
shorthand label reads as the same number as a braced answer. `to_number` reads a
normalized numeric answer (trailing units allowed) as an exact Fraction, and
`same_text` compares non-numeric answers as strings, ignoring case for text
answers ("No solution" == "no solution").
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from furlong.rewards.latex_args import brace_group

REL_TOL = 1e-6           # relative tolerance for numeric equality
MAX_FRAC_NESTING = 8     # deeper `\frac` nesting is left as written (bounds the recursion)

_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRACTION_RE = re.compile(r"([+-]?)\\frac\{(\d+)\}\{(\d+)\}")
_MIXED_RE = re.compile(r"([+-]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}")
_SLASH_RE = re.compile(r"[+-]?(\d+)\s*/\s*(\d+)")
# What may follow a number as a unit: words separated from it ("5 m", "18 dollars
# per day"), 2+ letters attached ("5cm") or a rate ("18/hour"). A single attached
# letter ("2x") is algebra, not a unit.
_UNIT_RE = re.compile(r"(?:\s+[A-Za-z]|[A-Za-z]{2}|\s*/\s*[A-Za-z]{2})[A-Za-z0-9\s.\-/'^()]*")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "\\%",
         "^{\\circ}", "^\\circ", "{}^\\circ", "\\circ", "°", "$", "%")
# A single-token TeX argument: a control word (`\pi`) or one character.
_TOKEN_RE = re.compile(r"\\[A-Za-z]+|[^\s{}\\]")
# A word of 2+ letters that is neither a LaTeX command (`\pi`) nor glued to a
# number or to other variables (`2xy` is algebra): its presence makes a text answer.
_WORD_RE = re.compile(r"(?<![\\A-Za-z0-9])[A-Za-z]{2,}")


def _frac_arg(s: str, i: int, depth: int) -> tuple[str, int] | None:
    """One `\\frac` argument at s[i], its shorthand inside expanded; None if missing/unclosed."""
    while i < len(s) and s[i] == " ":
        i += 1
    if s[i:i + 1] == "{":
        group = brace_group(s, i)
        return None if group is None else (expand_frac_shorthand(group[0], depth + 1), group[1])
    token = _TOKEN_RE.match(s, i)
    return None if token is None else (token.group(0), token.end())


def expand_frac_shorthand(s: str, depth: int = 0) -> str:
    """`\\frac34`, `\\frac3{4}`, `\\frac 3 4` -> `\\frac{3}{4}` (also nested); braced forms unchanged."""
    if depth > MAX_FRAC_NESTING or "\\frac" not in s:
        return s
    out, i = [], 0
    while (j := s.find("\\frac", i)) >= 0:
        k = j + len("\\frac")
        num = _frac_arg(s, k, depth)
        den = num and _frac_arg(s, num[1], depth)
        if not den:  # malformed or truncated: keep the rest as written (and the cost linear)
            break
        out.append(f"{s[i:j]}\\frac{{{num[0]}}}{{{den[0]}}}")
        i = den[1]
    out.append(s[i:])
    return "".join(out)


def normalize(answer: str) -> str:
    """Strip presentation (wrappers, currency, percent, thousands commas, spacing)."""
    s = answer.replace("\u2212", "-").replace("\u00a0", " ").replace("{,}", ",")
    for _ in range(3):  # \text{\textbf{..}} nests rarely deeper than this
        s = _TEXT_CMD_RE.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = expand_frac_shorthand(s)
    s = _THOUSANDS_RE.sub("", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.rstrip(".").strip()
    return s


def rhs(s: str) -> str:
    """`x = 5` -> `5` (used when the label has no `=`, so the value is what is compared)."""
    return s.rsplit("=", 1)[1].strip() if "=" in s else s


def _is_unit(rest: str) -> bool:
    return rest == "" or _UNIT_RE.fullmatch(rest) is not None


def to_number(s: str) -> Fraction | None:
    """The value of a normalized numeric answer, allowing trailing units; else None."""
    s = s.strip()
    m = _MIXED_RE.match(s) or _FRACTION_RE.match(s) or _SLASH_RE.match(s)
    if m and _is_unit(s[m.end():]):
        *whole, num, den = m.groups()
        if int(den) == 0:
            return None
        sign = -1 if m.group(0).lstrip().startswith("-") else 1
        integer = abs(int(whole[1])) if len(whole) == 2 else 0
        return sign * (integer + Fraction(abs(int(num)), int(den)))
    m = _NUMBER_RE.match(s)
    if m and _is_unit(s[m.end():]):
        text = m.group(0)
        if re.search(r"[eE][+-]?\d{4}", text):  # 1e9999: a huge exact integer, not an answer
            return None
        return Fraction(text)
    return None


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exact for two integers (so 1000000 != 1000001); else relative tolerance REL_TOL."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return a == b or math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)


def is_text_answer(s: str) -> bool:
    """Whether `s` contains a word (`no solution`, `Monday`), not only math symbols."""
    return _WORD_RE.search(s) is not None


def same_text(a: str, b: str) -> bool:
    """String equality ignoring spaces; also ignoring case when either side is a text answer.

    Case is kept for pure expressions because `x` and `X` are different variables."""
    a, b = a.replace(" ", ""), b.replace(" ", "")
    if a == b:
        return True
    return (is_text_answer(a) or is_text_answer(b)) and a.casefold() == b.casefold()
