"""Math answer reward (DESIGN.md §6): 1.0 if the response's final answer equals the label.

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
`=`):
  * numbers (decimals, `3/4`, `\\frac{3}{4}`, `\\dfrac`, mixed numbers `1\\frac{1}{2}`,
    a leading `+`, words/units after the number such as "18 dollars" or "5 cm")
    are equal within a relative tolerance of 1e-6, except that two integers must
    be equal exactly (1000000 vs 1000001 is wrong, though within 1e-6);
  * otherwise the normalized strings are equal;
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

import math
import re
from fractions import Fraction

REL_TOL = 1e-6           # relative tolerance for numeric equality
MAX_SYMPY_CHARS = 200    # longer expressions are not handed to sympy (cost bound)
MAX_EXPONENT_DIGITS = 4  # integer exponents above 9999 are refused (huge integers)
NUM_TEST_POINTS = 3      # points of the numeric identity test for expressions with variables

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_HASH_RE = re.compile(r"####")
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<eot>")
_ANSWER_IS_RE = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?", re.IGNORECASE)
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
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


# ---------------------------------------------------------------- extraction

def _brace_group(text: str, start: int) -> tuple[str, int] | None:
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


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOX_RE.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            group = _brace_group(text, i)
            if group is not None:
                return group[0]
        elif i > m.end():  # `\boxed 5`: one token up to whitespace or `$`
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                return token.group(0)
    return None


def _sentence(tail: str) -> str:
    """The answer phrase at the start of `tail`: up to the line end, sentence end or ', '."""
    tail = tail.strip().split("\n", 1)[0]
    tail = re.split(r"\.(?=\s|$)|,\s", tail, maxsplit=1)[0]
    return tail.strip().strip("*_").strip()  # markdown bold/italic around the answer


def extract_answer(response: str) -> str | None:
    """The final answer of a response (rules in the module docstring), or None."""
    response = _SPECIAL_TOKEN_RE.sub(" ", response)  # responses keep special tokens
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    hashes = list(_HASH_RE.finditer(response))
    if hashes:
        return _sentence(response[hashes[-1].end():])
    said = list(_ANSWER_IS_RE.finditer(response))
    if said:
        return _sentence(response[said[-1].end():])
    return None


# ------------------------------------------------------------- normalization

def normalize(answer: str) -> str:
    """Strip presentation (wrappers, currency, percent, thousands commas, spacing)."""
    s = answer.replace("\u2212", "-").replace("\u00a0", " ").replace("{,}", ",")
    for _ in range(3):  # \text{\textbf{..}} nests rarely deeper than this
        s = _TEXT_CMD_RE.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _THOUSANDS_RE.sub("", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.rstrip(".").strip()
    return s


def _rhs(s: str) -> str:
    """`x = 5` -> `5` (the label has no `=`, so the value is what is compared)."""
    return s.rsplit("=", 1)[1].strip() if "=" in s else s


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


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exact for two integers (so 1000000 != 1000001); else relative tolerance REL_TOL."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return a == b or math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)


def _is_unit(rest: str) -> bool:
    return rest == "" or _UNIT_RE.fullmatch(rest) is not None


# ------------------------------------------------------------------ symbolic

_FUNCTIONS = {"sqrt", "sin", "cos", "tan", "log", "exp", "pi", "oo"}
_LATEX_WORDS = {"\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": " pi ", "\\infty": " oo ",
                "\\ln": " log ", "\\log": " log ", "\\sin": " sin ", "\\cos": " cos ",
                "\\tan": " tan ", "\\exp": " exp "}


def _arg(s: str, i: int) -> tuple[str, int] | None:
    """A LaTeX macro argument at s[i]: `{...}` or one character (`\\frac12`)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        return _brace_group(s, i)
    return s[i], i + 1


def _latex_to_sympy(s: str) -> str | None:
    """Translate `\\frac`, `\\sqrt`, `^`, braces and a few macros; None if untranslatable."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num = _arg(s, i + 5)
            den = num and _arg(s, num[1])
            if not den:
                return None
            a, b = _latex_to_sympy(num[0]), _latex_to_sympy(den[0])
            if a is None or b is None:
                return None
            out.append(f"(({a})/({b}))")
            i = den[1]
        elif s.startswith("\\sqrt", i):
            j, root = i + 5, None
            if j < len(s) and s[j] == "[":
                close = s.find("]", j)
                if close < 0:
                    return None
                root, j = _latex_to_sympy(s[j + 1:close]), close + 1
            body = _arg(s, j)
            inner = body and _latex_to_sympy(body[0])
            if not inner or (root is None and s[i + 5:i + 6] == "["):
                return None
            out.append(f"(({inner})**(1/({root})))" if root else f"sqrt({inner})")
            i = body[1]
        else:
            word = next((w for w in _LATEX_WORDS if s.startswith(w, i)
                         and not s[i + len(w):i + len(w) + 1].isalpha()), None)
            if word:
                out.append(_LATEX_WORDS[word])
                i += len(word)
            else:
                out.append(s[i])
                i += 1
    text = "".join(out).replace("{", "(").replace("}", ")").replace("^", "**")
    return None if "\\" in text else text


def _split_letters(m: re.Match) -> str:
    word = m.group(0)
    if word in _FUNCTIONS:
        return word
    return "*".join(word) if len(word) <= 3 else "\x00"  # \x00 marks a refused word


def _safe_sympy_text(s: str) -> str | None:
    """Sympy input built from a whitelist, or None if it could be slow or unsafe."""
    if len(s) > MAX_SYMPY_CHARS:
        return None
    text = _latex_to_sympy(s)
    if text is None or not re.fullmatch(r"[0-9A-Za-z+\-*/().\s]*", text):
        return None
    text = re.sub(r"[A-Za-z]+", _split_letters, text)
    if "\x00" in text or not text.strip():
        return None
    for m in re.finditer(r"\*\*\s*", text):  # bound the size of any power
        rest = text[m.end():]
        operand = _brace_group(rest.replace("(", "{").replace(")", "}"), 0) if rest[:1] == "(" else None
        if operand is not None:
            inner, after = operand
        else:
            tok = re.match(r"[+-]?[0-9A-Za-z.]*", rest)
            inner, after = tok.group(0), tok.end()
        if "**" in inner or rest[after:].lstrip().startswith("**"):
            return None
        if any(len(d) > MAX_EXPONENT_DIGITS for d in re.findall(r"\d+", inner)):
            return None
    return text


def _sympy_equal(a: str, b: str) -> bool:
    ta, tb = _safe_sympy_text(a), _safe_sympy_text(b)
    if ta is None or tb is None:
        return False
    import sympy  # imported lazily: it costs ~1 s and most answers never need it
    from sympy.parsing.sympy_parser import (implicit_multiplication, parse_expr,
                                            standard_transformations)
    names = {c: sympy.Symbol(c) for c in "abcdfghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(e=sympy.E, pi=sympy.pi, oo=sympy.oo, sqrt=sympy.sqrt, sin=sympy.sin,
                 cos=sympy.cos, tan=sympy.tan, log=sympy.log, exp=sympy.exp)
    transforms = standard_transformations + (implicit_multiplication,)
    # The parser emits Integer(..)/Float(..)/Symbol(..) calls; nothing else is reachable
    # because the text was whitelisted above.
    builtins = {k: getattr(sympy, k) for k in ("Integer", "Float", "Rational", "Symbol")}
    try:
        ea = parse_expr(ta, local_dict=dict(names), global_dict=dict(builtins), transformations=transforms)
        eb = parse_expr(tb, local_dict=dict(names), global_dict=dict(builtins), transformations=transforms)
    except Exception:  # noqa: BLE001 - untrusted text: tokenizer/syntax/type errors all mean "no match"
        return False
    if not (isinstance(ea, sympy.Expr) and isinstance(eb, sympy.Expr)):
        return False
    if ea.is_Rational and eb.is_Rational:  # exact values (integers stay exact)
        return bool(ea == eb)
    symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
    if not symbols:
        va, vb = _value(ea, {}), _value(eb, {})
        return va is not None and vb is not None and _close(va, vb)
    # Identity test at fixed, "generic" points (positive, so sqrt/log stay real):
    # two different expressions agreeing at all of them is vanishingly unlikely.
    agreed = 0
    for k in range(NUM_TEST_POINTS):
        point = {x: sympy.Float(0.5377 + 0.8123 * k + 0.2719 * j, 30) for j, x in enumerate(symbols)}
        va, vb = _value(ea, point), _value(eb, point)
        if va is None or vb is None:
            continue
        if not _close(va, vb):
            return False
        agreed += 1
    return agreed >= 2


def _value(expr, point: dict):
    """Value of `expr` at `point` as a 30-digit sympy number, or None if undefined/infinite.

    Stays in sympy (not Python complex) so huge magnitudes like 1.37**9999 compare fine."""
    try:
        v = expr.evalf(30, subs=point)
    except Exception:  # noqa: BLE001 - e.g. a function of the wrong arity: undefined here
        return None
    return v if v.is_number and v.is_finite else None


def _close(va, vb) -> bool:
    return bool(abs(va - vb) <= REL_TOL * max(abs(va), abs(vb)) + 1e-12)


# ------------------------------------------------------------------- scoring

def answers_match(answer: str, label: str) -> bool:
    """Whether an extracted answer equals the label (rules in the module docstring)."""
    a, b = normalize(answer), normalize(label)
    if "=" not in b:
        a = _rhs(a)
    if not a or not b:
        return False
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return _numbers_equal(na, nb)
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    return _sympy_equal(a, b)


def math_score(response: str, label: str) -> float:
    """1.0 if the response's final answer equals the label, else 0.0; never raises."""
    try:
        if "\\boxed" in label or "\\fbox" in label:
            label = _last_boxed(label) or label
        answer = extract_answer(response)
        if answer is None:
            return 0.0
        return 1.0 if answers_match(answer, label) else 0.0
    except Exception:  # noqa: BLE001 - model output must never crash the trainer
        return 0.0
