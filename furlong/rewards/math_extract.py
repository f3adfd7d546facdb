"""Final-answer extraction for the `math` reward (rules in math_reward's docstring).

First rule that finds something wins: the last complete `\\boxed{...}`/`\\fbox{...}`
(or bare `\\boxed 5`), then the line after the last `####`, then the phrase after
the last "the answer is". Special tokens kept in decoded responses (`<|im_end|>`,
`</s>`, ...) are blanked first so they never become part of an answer.
"""
from __future__ import annotations

import re

from furlong.rewards.latex_args import brace_group

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_HASH_RE = re.compile(r"####")
SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<eot>")
_ANSWER_IS_RE = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{}`/`\\fbox{}` (or `\\boxed 5` token); None if none.

    A truncated (unclosed) box is skipped in favour of an earlier complete one."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            group = brace_group(text, i)
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
    """The final answer of a response (rules in math_reward's docstring), or None."""
    response = SPECIAL_TOKEN_RE.sub(" ", response)  # responses keep special tokens
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    hashes = list(_HASH_RE.finditer(response))
    if hashes:
        return _sentence(response[hashes[-1].end():])
    said = list(_ANSWER_IS_RE.finditer(response))
    if said:
        return _sentence(response[said[-1].end():])
    return None
