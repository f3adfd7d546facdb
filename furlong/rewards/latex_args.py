"""LaTeX argument parsing shared by answer extraction, normalization and the symbolic check.

A macro argument is either a brace group `{...}` (brace-matched, so nesting works)
or, as in TeX, one single character (`\\frac12` is `\\frac{1}{2}`). An unclosed
brace (a truncated response) yields None rather than the rest of the text.
"""
from __future__ import annotations


def brace_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the `{...}` opening at text[start] and the index after it; None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def latex_arg(s: str, i: int) -> tuple[str, int] | None:
    """A LaTeX macro argument at s[i] (spaces skipped): `{...}` or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        return brace_group(s, i)
    return s[i], i + 1
