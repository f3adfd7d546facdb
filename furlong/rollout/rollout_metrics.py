"""A rollout's metrics (miles' names, docs/design.md §7): what the rollouts of rollout.py,
async_rollout.py and custom_rollout.py report, summarized from the kept groups and the engine's counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from furlong.types import Group, Sample


@dataclass
class RolloutMetrics:
    num_dropped: dict[str, int]      # groups failing the filter, by filter name
    num_aborted: int                 # groups still in flight when enough were kept
    num_generated_groups: int        # groups finished over all ranks (kept + dropped)
    raw_reward: float                # mean reward over kept samples
    response_len_mean: float         # tokens, kept samples
    response_len_max: int            # tokens, kept samples
    truncated_ratio: float           # kept samples that hit the max response length
    rollout_log_probs: float         # mean engine log-prob over kept response tokens
    num_generated_tokens: int        # response tokens generated over all ranks (aborted ones too)
    seconds: float                   # wall clock of the whole rollout
    reward_seconds: float            # of which in reward functions (this rank's groups)
    engine: dict[str, float] = field(default_factory=dict)   # this rank's engine counters (perf/*)
    trained_tokens_mean: float = 0.0     # loss-mask tokens per kept sample (model tokens; tool tokens excluded)
    turns_mean: float = 1.0              # model turns per kept sample
    num_failed_samples: int = 0          # custom generate failures dropped with their groups (on-error drop)
    tool_call_ratio: float | None = None  # kept samples that called a tool (None: the generate function counts none)
    custom: dict[str, float] = field(default_factory=dict)   # a --rollout-function-path's own metrics, by log name
    # --partial-rollout (None: off): samples of paused groups resumed in this rollout, samples paused at its
    # end, and the share of the kept response tokens generated in earlier rollouts (rollout/partial.py)
    num_partial_resumed: int | None = None
    num_partial_paused: int | None = None
    partial_offpolicy_token_frac: float | None = None

    def as_log(self) -> dict[str, float]:
        """miles metric names (docs/design.md §7), plus the engine's perf counters."""
        out = {
            "rollout/raw_reward": self.raw_reward,
            "rollout/response_len/mean": self.response_len_mean,
            "rollout/response_len/max": float(self.response_len_max),
            "rollout/truncated_ratio": self.truncated_ratio,
            "rollout/rollout_log_probs": self.rollout_log_probs,
            "rollout/num_generated_groups": float(self.num_generated_groups),
            "rollout/dynamic_filter/num_aborted": float(self.num_aborted),
            "rollout/trained_tokens/mean": self.trained_tokens_mean,
            "rollout/turns/mean": self.turns_mean,
            "rollout/custom_generate/num_failed": float(self.num_failed_samples),
            "perf/rollout_time": self.seconds,
            "perf/rollout_tok_per_s": self.num_generated_tokens / max(self.seconds, 1e-9),
            "perf/reward_time": self.reward_seconds,
            **self.engine,
            **self.custom,
        }
        if self.tool_call_ratio is not None:
            out["rollout/tool_call_ratio"] = self.tool_call_ratio
        for name, count in self.num_dropped.items():
            out[f"rollout/dynamic_filter/drop_{name}"] = float(count)
        if self.num_partial_resumed is not None:
            out["rollout/partial/num_resumed"] = float(self.num_partial_resumed)
            out["rollout/partial/num_paused"] = float(self.num_partial_paused or 0)
            out["rollout/partial/offpolicy_token_frac"] = float(self.partial_offpolicy_token_frac or 0.0)
        return out


def engine_metrics(stats: Any) -> dict[str, float]:
    """The engine's counters of one rollout as perf/ metrics (this rank's engine)."""
    return {
        "perf/decode_steps_per_s": stats.num_decode_steps / max(stats.seconds, 1e-9),
        "perf/rollout_mean_running_batch": stats.mean_batch,
        "perf/rollout_mean_context": stats.mean_context,   # tokens each decode row attends to
        "perf/rollout_kv_utilization": stats.kv_utilization,
        "perf/rollout_cascade_row_fraction": stats.grouped_fraction,
        "perf/rollout_num_preemptions": float(stats.num_preemptions),
        "perf/rollout_num_prefill_steps": float(stats.num_prefill_steps),
        "perf/rollout_num_mixed_steps": float(stats.num_mixed_steps),   # of those, behind a decode window
    }


def tool_call_ratio(samples: list[Sample]) -> float | None:
    """The share of `samples` whose metadata["num_tool_calls"] (a custom generate function's count, as
    tools/calculator_generate.py keeps it) is above 0; None when no sample carries that count."""
    counts = [s.metadata["num_tool_calls"] for s in samples if "num_tool_calls" in s.metadata]
    return sum(c > 0 for c in counts) / len(samples) if counts else None


def summarize(kept: list[Group], dropped: dict[str, int], num_aborted: int, num_finished: int,
               num_generated_tokens: int, seconds: float, reward_seconds: float, stats: Any,
               num_failed: int = 0) -> RolloutMetrics:
    samples = [s for g in kept for s in g.samples]
    lens = [len(s.response_ids) for s in samples]
    num = max(len(samples), 1)
    num_trained = sum(s.num_trained_tokens for s in samples)
    model_lp = sum(sum(s.rollout_log_probs) if s.loss_mask is None else
                   sum(lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m) for s in samples)
    return RolloutMetrics(
        num_dropped=dropped, num_aborted=num_aborted, num_generated_groups=num_finished,
        raw_reward=sum(s.reward for s in samples) / num,
        response_len_mean=sum(lens) / num, response_len_max=max(lens, default=0),
        truncated_ratio=sum(s.truncated for s in samples) / num,
        rollout_log_probs=model_lp / max(num_trained, 1),   # model tokens only: tool tokens have no log-prob
        num_generated_tokens=num_generated_tokens, seconds=seconds, reward_seconds=reward_seconds,
        engine=engine_metrics(stats), trained_tokens_mean=num_trained / num,
        turns_mean=sum(s.num_turns for s in samples) / num, num_failed_samples=num_failed,
        tool_call_ratio=tool_call_ratio(samples))
