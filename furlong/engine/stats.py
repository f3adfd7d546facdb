"""The engine's counters: what its steps did since the last `Engine.reset_stats` (logged per rollout)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from furlong.engine.plan import Plan


@dataclass
class EngineStats:
    num_prefill_steps: int = 0        # steps that prefilled (alone, or mixed behind a decode window)
    num_mixed_steps: int = 0          # of those, run behind a decode window (scheduler.py, Mixed)
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0        # continuations' prompt tokens read from retained KV, not prefilled
    num_decode_steps: int = 0
    num_decode_rows: int = 0          # sum over decode steps of running rows
    num_grouped_rows: int = 0         # of those, rows that read their prompt's KV once per group (cascade)
    num_context_tokens: int = 0       # sum over decode steps and rows of the tokens the row attends to (its
                                      # whole context, cascade or not): the KV a decode reads, in tokens
    num_generated_tokens: int = 0     # kept tokens (after stops), all sequences
    num_preemptions: int = 0
    kv_used_sum: float = 0.0          # sum over decode windows of used/total pages
    num_windows: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0      # of `seconds`, the prefill-only steps' (each step ends in a host sync
                                      # for its sampled tokens, so a step's wall time is its device time too;
                                      # a mixed step's prefill is not timed apart from its window)

    @property
    def mean_batch(self) -> float:
        return self.num_decode_rows / max(self.num_decode_steps, 1)

    @property
    def mean_context(self) -> float:
        """Tokens a decode row attends to, on average: with mean_batch, what sets a step's attention cost."""
        return self.num_context_tokens / max(self.num_decode_rows, 1)

    @property
    def grouped_fraction(self) -> float:
        return self.num_grouped_rows / max(self.num_decode_rows, 1)

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_sum / max(self.num_windows, 1)

    def count_step(self, plan: Plan, num_grouped_rows: int) -> None:
        """One engine step's counts (generated tokens are counted after the stop rules, by the scheduler)."""
        if plan.prefill:
            self.num_prefill_steps += 1
            self.num_mixed_steps += bool(plan.decode)
            self.num_prefill_tokens += sum(len(item.token_ids) for item in plan.prefill)
            self.num_cached_tokens += sum(item.start for item in plan.prefill)
        if not plan.decode:
            return
        w = plan.window
        self.kv_used_sum += plan.kv_used
        self.num_windows += 1
        self.num_decode_steps += w
        self.num_decode_rows += w * len(plan.decode)
        self.num_grouped_rows += w * num_grouped_rows
        # each row attends to its T tokens (T - 1 cached and its input), T + 1, .. over the window,
        # whether or not it stops inside it (the window runs whole on the device)
        self.num_context_tokens += sum(w * s.num_tokens + w * (w - 1) // 2 for s in plan.decode)

    def take(self) -> EngineStats:
        """The counters so far; starts them anew (the scheduler keeps counting into this object)."""
        old = copy.copy(self)
        self.__dict__.update(EngineStats().__dict__)
        return old
