"""`--rm-type deepscaler`: DeepScaleR's rule-based math reward, with the answer rules of miles.

Algorithm (as in miles/slime `rollout/rm_hub/deepscaler.py`), reward 1.0 or 0.0:
  1. The graded text is what follows the LAST `</think>`. A response without
     `</think>` but with `###Response` is graded on the text after the first
     `###Response` (up to a second one, if any). A response with neither scores
     0: a reasoning model that never closed its thinking has given no answer.
  2. The answer is the content of the LAST `\\boxed` of the graded text, which
     must be followed directly by a complete brace group. Only that last one
     counts: if it is truncated (unclosed) or written without braces
     (`\\boxed 5`), the score is 0 even when an earlier box is complete. Unlike
     `--rm-type math`, there is no `\\fbox`, `####` or "the answer is" fallback.
  3. A label containing `\\boxed` is reduced to its answer by the same rule (0 if
     that fails); an empty label scores 0.
  4. 1.0 if the answer equals the label under furlong's math equivalence
     (`answers_match`, rules in math_reward), else 0.0.
Deliberate deviation: step 4 uses furlong's checker instead of DeepScaleR's
Hendrycks normalizer + `sympy.simplify` (which needs a timeout and pylatexenc).
So, unlike miles: equal values in other forms are accepted where DeepScaleR is
stricter (`2/4` vs `1/2`, `\\frac{4}{2}` vs `2`, `0.333333` vs `\\frac{1}{3}`
within 1e-6), any words after a number count as units (DeepScaleR strips a
fixed unit list and a trailing `\\text{ ...}`), and "million"/"billion" are not
expanded. Text answers compare case-insensitively in both. Never raises.
"""
from __future__ import annotations

from furlong.rewards.latex_args import brace_group
from furlong.rewards.math_reward import answers_match

THINK_END = "</think>"
RESPONSE_MARK = "###Response"


def graded_part(response: str) -> str | None:
    """The text after the last `</think>` (else after the first `###Response`); None if neither."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if RESPONSE_MARK in response:
        return response.split(RESPONSE_MARK, 2)[1]
    return None


def strict_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed` if a complete `{...}` follows it directly; else None.

    No fallback to an earlier box: a truncated final answer is no answer."""
    at = text.rfind("\\boxed")
    if at < 0:
        return None
    start = at + len("\\boxed")
    if text[start:start + 1] != "{":
        return None
    group = brace_group(text, start)
    return None if group is None else group[0]


def _label_answer(label: str) -> str | None:
    if "\\boxed" in label:
        return strict_last_boxed(label)
    return label if label.strip() else None


def deepscaler_score(response: str, label: str) -> float:
    """1.0 if the boxed answer after `</think>` equals the label, else 0.0; never raises."""
    try:
        part = graded_part(response)
        answer = strict_last_boxed(part) if part is not None else None
        truth = _label_answer(str(label))
        if answer is None or truth is None:
            return 0.0
        return 1.0 if answers_match(answer, truth) else 0.0
    except Exception:  # noqa: BLE001 - model output must never crash the trainer
        return 0.0

