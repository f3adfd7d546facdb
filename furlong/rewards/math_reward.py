"""Math answer reward (docs/design.md §6): 1.0 if the response's final answer equals the label.

Code: extraction in math_extract, normalization and numbers in math_normalize,
the sympy step in math_symbolic; this module combines them and re-exports their
public functions (`extract_answer`, `normalize`, `to_number`) from here.

Extraction (first rule that finds something wins):
  1. the LAST complete `\\boxed{...}` / `\\fbox{...}` (brace-matched, so nested
     braces such as `\\boxed{\\frac{1}{2}}` work), or the bare form `\\boxed 5`;
     an unclosed brace (a truncated response) does not count;
  2. the rest of the line after the last `####` (GSM8K reference style);
  3. the text after the last "the answer is" / "the final answer is" (any case),
     up to the end of the sentence.
There is deliberately no "last number in the text" fallback: it would reward
responses that never commit to an answer.

Comparison, after normalizing both sides the same way (LaTeX wrappers such as
`\\text{}`, `\\$`, `\\,`, `\\!`, `^\\circ` and `\\left/\\right` are dropped, `$` and `%`
removed, thousands commas removed, `x = 5` reduced to `5` when the label has no
`=`, and the TeX shorthand `\\frac34` written `\\frac{3}{4}`):
  * numbers (decimals, `3/4`, `\\frac{3}{4}`, `\\dfrac`, mixed numbers `1\\frac{1}{2}`,
    a leading `+`, words/units after the number such as "18 dollars" or "5 cm")
    are equal within a relative tolerance of 1e-6, except that two integers must
    be equal exactly (1000000 vs 1000001 is wrong, though within 1e-6);
  * otherwise the normalized strings are equal, ignoring case when either side
    is a text answer (has a word of 2+ letters: `No solution` == `no solution`;
    `x` and `X` stay different variables);
  * otherwise both sides are parsed by sympy (after translating `\\frac`,
    `\\sqrt`, `^`, `\\cdot`, `\\pi`, ...) and compared: exactly when both are
    rationals, else by value at 30 digits (relative tolerance 1e-6) — for
    expressions with variables, at 3 fixed generic points (a deterministic
    polynomial-identity style test).
Deviations, both for bounded cost: (1) `simplify(a - b) == 0` is not used; it
can take minutes (e.g. expanding `(x+1)^{9999} - (x+2)^{9998}`), while numeric
evaluation at fixed points cannot blow up and agrees with it on real answers.
(2) There is no wall-clock timeout, which keeps the reward deterministic and
thread-safe; instead inputs longer than 200 characters, characters outside a
small whitelist, unknown multi-letter names and nested or >9999 exponents are
refused (scored 0). Any exception inside scoring also gives 0, so model output
can never crash training.
"""
from __future__ import annotations

from furlong.rewards.math_extract import extract_answer, last_boxed
from furlong.rewards.math_normalize import REL_TOL, normalize, numbers_equal, rhs, same_text, to_number
from furlong.rewards.math_symbolic import (MAX_EXPONENT_DIGITS, MAX_SYMPY_CHARS, NUM_TEST_POINTS,
                                           sympy_equal)

__all__ = ["answers_match", "math_score", "extract_answer", "normalize", "to_number", "REL_TOL",
           "MAX_SYMPY_CHARS", "MAX_EXPONENT_DIGITS", "NUM_TEST_POINTS"]


def answers_match(answer: str, label: str) -> bool:
    """Whether an extracted answer equals the label (rules in the module docstring)."""
    a, b = normalize(answer), normalize(label)
    if "=" not in b:
        a = rhs(a)
    if not a or not b:
        return False
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return numbers_equal(na, nb)
    return same_text(a, b) or sympy_equal(a, b)


def math_score(response: str, label: str) -> float:
    """1.0 if the response's final answer equals the label, else 0.0; never raises."""
    try:
        if "\\boxed" in label or "\\fbox" in label:
            label = last_boxed(label) or label
        answer = extract_answer(response)
        if answer is None:
            return 0.0
        return 1.0 if answers_match(answer, label) else 0.0
    except Exception:  # noqa: BLE001 - model output must never crash the trainer
        return 0.0
