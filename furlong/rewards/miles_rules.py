"""miles' simple rule rewards: `f1` (token-overlap F1 with the label), `random` and
`deterministic_random` (coin flips, for plumbing tests), and the `boxed_` prefix of --rm-type.

  f1                    SQuAD-style F1 of the normalized response and label tokens (lowercase, no
                        punctuation, no articles a/an/the, single spaces); 0 when either side is
                        yes/no/noanswer and they differ, or when no token is shared.
  random                0 or 1. Deviation from miles (an unseeded random.randint): drawn from a
                        stream seeded by --seed, so a seeded run repeats.
  deterministic_random  0 or 1 from sha256(str(prompt + response token ids) + response text), as miles:
                        the same sample always gets the same reward, whatever the seed.
  boxed_<type>          <type> scored on the content of the response's last \\boxed{...} ("" when there
                        is none), miles' extraction: the last `\\boxed` (else `\\fbox`), its braces
                        matched; a `\\fbox{}` or unclosed box gives "".
"""
from __future__ import annotations

import hashlib
import random
import re
import string
import threading
from collections import Counter
from typing import Callable

from furlong.types import Sample

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


def _normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(response: str, label: str) -> float:
    """F1 of the normalized response tokens against the label's (module docstring)."""
    pred, gold = _normalize(response), _normalize(label)
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def boxed_content(response: str) -> str | None:
    """miles' `extract_boxed_answer`: the last \\boxed{...}'s content, None when it has none (module docstring)."""
    start = response.rfind("\\boxed")
    if start < 0:
        start = response.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(response)):
        if response[i] == "{":
            depth += 1
        elif response[i] == "}":
            depth -= 1
            if depth == 0:
                box = response[start:i + 1]
                return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else None
    return None


def boxed(scorer: Callable[[str, str], float]) -> Callable[[str, str], float]:
    def score(response: str, label: str) -> float:
        return scorer(boxed_content(response) or "", label)
    return score


def deterministic_random_reward(sample: Sample) -> float:
    digest = hashlib.sha256((str(sample.tokens) + sample.response_text).encode()).digest()
    return float(digest[0] % 2)


class SeededCoin:
    """--rm-type random: 0/1 draws from one stream seeded by --seed (one lock: reward calls may come
    from several threads); on data-parallel ranks the seed is mixed with the rank so ranks differ."""

    def __init__(self, seed: int, rank: int = 0):
        self._rng = random.Random(f"{seed}:{rank}")
        self._lock = threading.Lock()
        self.__qualname__ = "random_reward"

    def __call__(self, sample: Sample) -> float:
        with self._lock:
            return float(self._rng.randint(0, 1))
