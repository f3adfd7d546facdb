"""Stop strings: the first generated token whose decoded text completes one.

A token j completes a stop string if the text of the tail tokens[j-M .. j]
contains it; M covers the longest stop string even at one character per token,
plus margin for multi-token characters. The new tokens of a window are decoded
once together with that tail; only when a stop string shows up there are the
tokens scanned one by one.
"""
from __future__ import annotations

from typing import Any


class StopStrings:
    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.tail = max((len(s) for s in stops), default=0) + 4     # M, in tokens

    def _has(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in self.stops)

    def first_hit(self, response: list[int], first_new: int) -> int | None:
        """Index j >= first_new of the token completing a stop string in `response`, or None."""
        if not self.stops or first_new >= len(response):
            return None
        if not self._has(response[max(0, first_new - self.tail):]):
            return None
        for j in range(first_new, len(response)):
            if self._has(response[max(0, j + 1 - self.tail):j + 1]):
                return j
        return None


def cut_after_stop(text: str, stops: list[str]) -> str:
    """Text up to and including the earliest-ending stop string."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text
