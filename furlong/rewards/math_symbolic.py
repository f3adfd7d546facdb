"""The symbolic step of the `math` reward: sympy equality with bounded cost (rules in math_reward).

Both answers are translated from LaTeX (`\\frac`, `\\sqrt`, `^`, `\\cdot`, `\\pi`, ...)
to sympy text built from a whitelist of characters, parsed without access to
Python builtins, and compared: exactly when both are rationals, else by value at
30 digits (relative tolerance REL_TOL); with variables, at NUM_TEST_POINTS fixed
generic points. Inputs that could be slow (long, nested or huge powers, unknown
multi-letter names) are refused, i.e. compare unequal.
"""
from __future__ import annotations

import re
from typing import Any

from furlong.rewards.latex_args import brace_group, latex_arg
from furlong.rewards.math_normalize import REL_TOL

MAX_SYMPY_CHARS = 200    # longer expressions are not handed to sympy (cost bound)
MAX_EXPONENT_DIGITS = 4  # integer exponents above 9999 are refused (huge integers)
NUM_TEST_POINTS = 3      # points of the numeric identity test for expressions with variables

_FUNCTIONS = {"sqrt", "sin", "cos", "tan", "log", "exp", "pi", "oo"}
_LATEX_WORDS = {"\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": " pi ", "\\infty": " oo ",
                "\\ln": " log ", "\\log": " log ", "\\sin": " sin ", "\\cos": " cos ",
                "\\tan": " tan ", "\\exp": " exp "}


def _frac_to_sympy(s: str, i: int) -> tuple[str, int] | None:
    """`\\frac{a}{b}` starting at s[i] as `((a)/(b))` and the index after it."""
    num = latex_arg(s, i + len("\\frac"))
    den = num and latex_arg(s, num[1])
    if not den:
        return None
    a, b = _latex_to_sympy(num[0]), _latex_to_sympy(den[0])
    if a is None or b is None:
        return None
    return f"(({a})/({b}))", den[1]


def _sqrt_to_sympy(s: str, i: int) -> tuple[str, int] | None:
    """`\\sqrt{x}` / `\\sqrt[n]{x}` starting at s[i] in sympy syntax and the index after it."""
    j, root = i + len("\\sqrt"), None
    if s[j:j + 1] == "[":
        close = s.find("]", j)
        if close < 0:
            return None
        root = _latex_to_sympy(s[j + 1:close])
        if root is None:  # an untranslatable index must not read as a square root
            return None
        j = close + 1
    body = latex_arg(s, j)
    inner = body and _latex_to_sympy(body[0])
    if not inner:
        return None
    return (f"(({inner})**(1/({root})))" if root else f"sqrt({inner})"), body[1]


def _latex_to_sympy(s: str) -> str | None:
    """Translate `\\frac`, `\\sqrt`, `^`, braces and a few macros; None if untranslatable."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i) or s.startswith("\\sqrt", i):
            done = (_frac_to_sympy if s.startswith("\\frac", i) else _sqrt_to_sympy)(s, i)
            if done is None:
                return None
            out.append(done[0])
            i = done[1]
            continue
        word = next((w for w in _LATEX_WORDS if s.startswith(w, i)
                     and not s[i + len(w):i + len(w) + 1].isalpha()), None)
        out.append(_LATEX_WORDS[word] if word else s[i])
        i += len(word) if word else 1
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
        operand = brace_group(rest.replace("(", "{").replace(")", "}"), 0) if rest[:1] == "(" else None
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


def _parse_both(ta: str, tb: str) -> tuple[Any, Any] | None:
    """Both whitelisted texts as sympy expressions; None if either does not parse to one."""
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
        return None
    if not (isinstance(ea, sympy.Expr) and isinstance(eb, sympy.Expr)):
        return None
    return ea, eb


def _equal_at_points(ea: Any, eb: Any, symbols: list[Any]) -> bool:
    """Identity test at fixed, "generic" points (positive, so sqrt/log stay real):
    two different expressions agreeing at all of them is vanishingly unlikely."""
    import sympy
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


def sympy_equal(a: str, b: str) -> bool:
    """Whether two normalized answers are the same expression (rules in the module docstring)."""
    ta, tb = _safe_sympy_text(a), _safe_sympy_text(b)
    if ta is None or tb is None:
        return False
    parsed = _parse_both(ta, tb)
    if parsed is None:
        return False
    ea, eb = parsed
    if ea.is_Rational and eb.is_Rational:  # exact values (integers stay exact)
        return bool(ea == eb)
    symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
    if symbols:
        return _equal_at_points(ea, eb, symbols)
    va, vb = _value(ea, {}), _value(eb, {})
    return va is not None and vb is not None and _close(va, vb)


def _value(expr: Any, point: dict) -> Any:
    """Value of `expr` at `point` as a 30-digit sympy number, or None if undefined/infinite.

    Stays in sympy (not Python complex) so huge magnitudes like 1.37**9999 compare fine."""
    try:
        v = expr.evalf(30, subs=point)
    except Exception:  # noqa: BLE001 - e.g. a function of the wrong arity: undefined here
        return None
    return v if v.is_number and v.is_finite else None


def _close(va: Any, vb: Any) -> bool:
    return bool(abs(va - vb) <= REL_TOL * max(abs(va), abs(vb)) + 1e-12)
