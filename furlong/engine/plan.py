"""What one engine step runs: the scheduler's plan (scheduler.py) for the model runner (model_runner.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from furlong.engine.sequence import Sequence


@dataclass
class PrefillItem:
    sequences: list[Sequence]    # [n] forks of one prompt, or one resumed sequence
    token_ids: list[int]         # tokens to prefill (prompt, or a resumed sequence's tokens)
    page_copies: list[tuple[int, int]]   # (src, dst) pages: the fork's copied last page, after the prefill
    start: int = 0               # position of token_ids[0]: tokens before it are in the cache (a continuation)


@dataclass
class Plan:
    prefill: list[PrefillItem]   # non-empty: a prefill step
    decode: list[Sequence]       # non-empty: a decode window over these rows
    window: int                  # decode steps in this window
    kv_used: float = 0.0         # decode: used / usable pages once the window's pages are taken
