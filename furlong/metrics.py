"""Run outputs: metrics.jsonl, the per-rollout progress line, TensorBoard, wandb.

Metric names follow miles (DESIGN.md §7) so dashboards carry over. Only rank 0
writes; other ranks get a logger whose methods do nothing.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


@dataclass
class Progress:
    """Rate and ETA over a fixed number of steps (wall clock, seconds)."""
    num_steps: int
    start_step: int = 0
    started: float = field(default_factory=time.monotonic)

    def eta(self, done_step: int) -> float:
        done = done_step - self.start_step
        if done <= 0:
            return math.inf
        per_step = (time.monotonic() - self.started) / done
        return per_step * (self.num_steps - done_step)


class MetricsLogger:
    """Writes one JSON line per logged step; mirrors to TensorBoard / wandb when enabled."""

    def __init__(self, output_dir: str | os.PathLike | None, enabled: bool = True, use_tensorboard: bool = False,
                 wandb_settings: dict[str, Any] | None = None, stream: TextIO | None = None):
        self.enabled = enabled and output_dir is not None
        self.stream = stream if stream is not None else sys.stdout
        self._file = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        out = Path(output_dir)  # type: ignore[arg-type]
        out.mkdir(parents=True, exist_ok=True)
        self._file = open(out / "metrics.jsonl", "a", buffering=1)
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(out / "tensorboard"))
        if wandb_settings is not None:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("--use-wandb: the wandb package is not installed (pip install wandb)") from e
            self._wandb = wandb.init(**wandb_settings)

    def log(self, step: int, metrics: dict[str, float], kind: str = "rollout") -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"kind": kind, "step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def line(self, text: str) -> None:
        if self.enabled or self.stream is not sys.stdout:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress_line(rollout_id: int, num_rollout: int, metrics: dict[str, float], eta_s: float) -> str:
    """One human line per rollout: step, reward, eval scores, throughput, time, ETA."""
    parts = [f"[rollout {rollout_id + 1}/{num_rollout}]"]
    if "rollout/raw_reward" in metrics:
        parts.append(f"reward {metrics['rollout/raw_reward']:.3f}")
    if "rollout/response_len/mean" in metrics:
        parts.append(f"len {metrics['rollout/response_len/mean']:.0f}")
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:+.4f}")
    if "train/num_micro_batches" in metrics:
        parts.append(f"mb {metrics['train/num_micro_batches']:.0f}")
    for k, v in metrics.items():
        if k.startswith("eval/"):
            parts.append(f"{k} {v:.3f}")
    if "perf/rollout_tok_per_s" in metrics:
        parts.append(f"gen {format_rate(metrics['perf/rollout_tok_per_s'])} tok/s")
    if "perf/actor_train_tok_per_s" in metrics:
        parts.append(f"train {format_rate(metrics['perf/actor_train_tok_per_s'])} tok/s")
    if "perf/step_time" in metrics:
        parts.append(f"step {metrics['perf/step_time']:.1f}s")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)
