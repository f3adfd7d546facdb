"""`--rm-type dapo`: DAPO's `Answer:` reward, with the answer rules of miles; 1.0 or -1.0.

Algorithm (miles/slime `rollout/rm_hub/math_dapo_utils.py`, `compute_score` with
its defaults, i.e. the Minerva check, not the strict-box one):
  1. Only the last TAIL_CHARS (300) characters of the response are read (DAPO's
     cost bound; its prompts ask for a last line `Answer: $Answer`).
  2. The answer is the rest of the line after the LAST `answer:` (any case, spaces
     around `:` allowed, anywhere in a line, so "Final answer: 5" counts; the
     whitespace after `:` may include a line break).
  3. Answer and label are normalized the same way (`normalize_final_answer`, below);
     then the label is read as a number and written as an integer, since DAPO's
     answers are integers (`1e3` -> `1000`, `12.0` -> `12`).
  4. Score 1.0 if the normalized answer is exactly that string, else -1.0 (also
     when there is no `answer:`). There is no numeric or symbolic equivalence:
     `5.0`, `+5`, `05` and `5.` (trailing period) are all wrong for label `5`.
miles returns a dict {"score", "acc", "pred"}; furlong rewards are floats, so
`dapo_score` returns the score, and `dapo_verdict` gives (acc, pred).

Normalization (DAPO's, from Minerva / lm-eval-harness): keep what follows the last
`=`; replace the substrings of _SUBSTITUTIONS in order (drops "a "/"an ", `\\$`,
every space, turns `\\text{and}` into a comma); delete the unit words and LaTeX
leftovers of _REMOVED in order; keep only the first `$...$` span of a line;
unwrap `\\text{}`, `\\textbf{}`, `\\overline{}` and `\\boxed{}`; write `\\fracab`
as `\\frac{a}{b}` and `\\sqrta` as `\\sqrt{a}`; drop `$`; drop the commas of a
comma-grouped integer (`1,000` -> `1000`, `-1,000` -> `-1000`); strip.

Deliberate deviations, on labels miles cannot score right: a label that is not a
number (miles raises ValueError) or not a whole number (miles truncates it, so
label `2.5` would accept `2`) is compared as its normalized string; an integer
label beyond float precision is read exactly (miles rounds it through a float,
so the right answer would fail). A response without `answer:` has pred None
(miles: "[INVALID]"). Never raises: any internal error scores -1.0.
"""
from __future__ import annotations

import math
import re

TAIL_CHARS = 300
CORRECT, INCORRECT = 1.0, -1.0

_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Order matters where one entry contains another (`\text{}^2` before `\text{}`).
_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)
_FIRST_MATH_SPAN_RE = re.compile(r".*?\$(.*?)\$.*")
_UNWRAP_RES = tuple(re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}",
                                           r"\\overline\{(.*?)\}", r"\\boxed\{(.*)\}"))
_FRAC_SHORTHAND_RE = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND_RE = re.compile(r"sqrt([^{])")
_PLAIN_INT_RE = re.compile(r"[+-]?\d+")
# A comma-grouped integer, optionally negative (miles drops the commas only when the rest is all
# digits, so "-1,000" keeps them and never equals "-1000": a miles bug, not followed).
_GROUPED_INT_RE = re.compile(r"-?[\d,]*\d[\d,]*")


def normalize_final_answer(answer: str) -> str:
    """DAPO's normalization of a final answer (steps in the module docstring)."""
    s = str(answer).split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for phrase in _REMOVED:
        s = s.replace(phrase, "")
    s = _FIRST_MATH_SPAN_RE.sub(r"$\1$", s)
    for wrapper in _UNWRAP_RES:
        s = wrapper.sub(r"\1", s)
    s = _FRAC_SHORTHAND_RE.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORTHAND_RE.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if _GROUPED_INT_RE.fullmatch(s.strip()):   # 1,000 and -1,000 alike
        s = s.replace(",", "")
    return s.strip()


def extract_dapo_answer(response: str) -> str | None:
    """The text after the last `answer:` in the response's last TAIL_CHARS characters, or None."""
    found = _ANSWER_RE.findall(response[-TAIL_CHARS:])
    return found[-1] if found else None


def _as_integer(normalized: str) -> str | None:
    """The normalized label written as an integer, or None if it is not a whole number."""
    if _PLAIN_INT_RE.fullmatch(normalized):  # exact, where a float would round big integers
        try:
            return str(int(normalized))
        except ValueError:  # beyond Python's int-from-string digit limit
            return None
    try:
        value = float(normalized)
    except ValueError:
        return None
    return str(int(value)) if math.isfinite(value) and value.is_integer() else None


def dapo_verdict(response: str, label: str) -> tuple[bool, str | None]:
    """(correct, normalized prediction) of DAPO's check; the prediction is None without `answer:`."""
    raw = extract_dapo_answer(response)
    if raw is None:
        return False, None
    pred = normalize_final_answer(raw)
    truth = normalize_final_answer(label)
    truth = _as_integer(truth) or truth
    return bool(truth) and pred == truth, pred


def dapo_score(response: str, label: str) -> float:
    """1.0 if the `Answer:` line equals the label after DAPO's normalization, else -1.0."""
    try:
        correct, _ = dapo_verdict(response, str(label))
    except Exception:  # noqa: BLE001 - model output must never crash the trainer
        return INCORRECT
    return CORRECT if correct else INCORRECT
