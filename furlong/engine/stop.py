"""Finishing rules: where a sequence's new tokens stop, and why.

A sequence finishes at
  * an EOS token (unless ignore_eos) or one of its stop_token_ids: the token is
    kept, finish_reason "stop";
  * a stop string: the response keeps every token up to and including the one
    completing it; the text is cut right after the string; "stop";
  * its request's max_new_tokens: "length";
  * `abort`: "abort" (what it generated so far; the scheduler's abort, not here).

Stop strings: token j completes a stop string if the text of the tail
tokens[j-M .. j] contains it; M covers the longest stop string even at one
character per token, plus margin for multi-token characters. The new tokens of
a window are decoded once together with that tail; only when a stop string
shows up there are the tokens scanned one by one.
"""
from __future__ import annotations

from typing import Any

from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Sequence


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


class StopRules:
    """The rules above for one engine (its tokenizer and EOS ids)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._stop_id_cache: dict[int, tuple[SamplingParams, frozenset[int]]] = {}   # id(params) -> stop ids

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        key = id(params)
        hit = self._stop_id_cache.get(key)
        if hit is None or hit[0] is not params:
            ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            hit = self._stop_id_cache[key] = (params, ids)
        return hit[1]

    def append(self, seq: Sequence, tokens: list[int], log_probs: list[float]) -> str | None:
        """Append a row's new tokens [w] (and log-probs [w]) to `seq` up to its first stop; returns the
        finish reason ("stop" | "length") or None while it runs on."""
        p = seq.params
        first_new = seq.num_generated
        keep = min(len(tokens), seq.max_new_tokens - first_new)
        reason = "length" if keep == seq.max_new_tokens - first_new else None
        stop_ids = self.stop_ids(p)
        if stop_ids and not stop_ids.isdisjoint(tokens[:keep]):
            keep = next(j for j, t in enumerate(tokens) if t in stop_ids) + 1
            reason = "stop"
        seq.token_ids.extend(tokens[:keep])
        seq.log_probs.extend(log_probs[:keep])
        if p.stop:
            hit = StopStrings(self.tokenizer, p.stop).first_hit(seq.response_ids, first_new)
            if hit is not None:
                del seq.token_ids[seq.num_prompt_tokens + hit + 1:]
                del seq.log_probs[hit + 1:]
                seq.stopped_by_string = True
                reason = "stop"
        return reason
