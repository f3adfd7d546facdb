"""Run outputs: metrics.jsonl, the per-rollout progress line, TensorBoard, wandb, sample dumps.

Metric names follow miles (docs/design.md §7) so dashboards carry over. Only rank 0
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

from furlong.types import Sample


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
                 wandb_settings: dict[str, Any] | None = None, stream: TextIO | None = None,
                 wandb_login: dict[str, Any] | None = None, tensorboard_dir: Path | None = None):
        """wandb_settings: wandb.init's kwargs (run/tracking.py), after wandb.login(**wandb_login) when
        given; tensorboard_dir: where the events go (default <output_dir>/tensorboard)."""
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
            self._tb = SummaryWriter(str(tensorboard_dir or out / "tensorboard"))
        if wandb_settings is not None:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("--use-wandb: the wandb package is not installed (pip install wandb)") from e
            if wandb_login is not None:
                wandb.login(**wandb_login)
            self._wandb = wandb.init(**wandb_settings)

    def log(self, step: int, metrics: dict[str, float], kind: str = "rollout") -> None:
        """One line {"kind", "step", metrics...}: `step` (miles' name) is the rollout id for rollout and
        eval lines, the optimizer step for sft lines."""
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        # NaN/inf are not JSON: written as null so every line stays parseable
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        self._file.write(json.dumps({"kind": kind, "step": step, **row}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def cut_back(self, last_step: int) -> int:
        """On resume: drop rollout lines after `last_step` (the loaded checkpoint's rollout id), so every
        rollout appears exactly once, in order, when the run goes on. Rewritten atomically; returns
        lines dropped."""
        if not self.enabled:
            return 0
        path = Path(self._file.name)
        self._file.close()
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1          # a line torn by a crash mid-write
                continue
            if row.get("kind") == "rollout" and int(row.get("step", -1)) > last_step:
                dropped += 1
            else:
                kept.append(line)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, path)
        self._file = open(path, "a", buffering=1)
        return dropped

    def line(self, text: str) -> None:
        if self.enabled or self.stream is not sys.stdout:
            try:
                print(text, file=self.stream, flush=True)
            except (BrokenPipeError, ValueError, OSError):
                # stdout was closed (`furlong train ... | head -1`): training goes on without printing,
                # and the interpreter's final flush of stdout must not fail either
                self.stream = open(os.devnull, "w")
                sys.stdout = self.stream

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


# (metric, formatter) shown in the progress line, in order
PROGRESS_FIELDS = (
    ("rollout/raw_reward", lambda v: f"reward {v:.3f}"),
    ("rollout/response_len/mean", lambda v: f"len {v:.0f}"),
    ("train/loss", lambda v: f"loss {v:+.4f}"),
    ("critic/value_loss", lambda v: f"vloss {v:.4f}"),
    ("train/num_micro_batches", lambda v: f"mb {v:.0f}"),
)


def progress_line(rollout_id: int, num_rollout: int, metrics: dict[str, float], eta_s: float) -> str:
    """One human line per rollout: step, reward, eval scores, throughput, time, ETA."""
    parts = [f"[rollout {rollout_id + 1}/{num_rollout}]"]
    for key, fmt in PROGRESS_FIELDS:
        if key in metrics:
            parts.append(fmt(metrics[key]))
    parts += [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/")]
    for key, label in (("perf/rollout_tok_per_s", "gen"), ("perf/actor_train_tok_per_s", "train")):
        if key in metrics:
            parts.append(f"{label} {format_rate(metrics[key])} tok/s")
    if "perf/step_time" in metrics:
        parts.append(f"step {metrics['perf/step_time']:.1f}s")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def write_samples(output_dir: Path, name: str, rollout_id: int, samples: list[Sample], prefix: str = "eval") -> None:
    """samples/{prefix}_{name}_{rollout_id + 1}.jsonl: eval responses, or a rollout's (--save-debug-rollout-data,
    with the token ids and log-probs --load-debug-rollout-data replays: run/debug_data.py)."""
    from furlong.run.debug_data import sample_row, write_rows
    rows = [sample_row(s) if prefix == "rollout" else
            {"prompt": s.prompt.text, "response": s.response_text, "label": s.prompt.label, "reward": s.reward,
             "finish_reason": s.finish_reason} for s in samples]
    write_rows(output_dir / "samples" / f"{prefix}_{name}_{rollout_id + 1}.jsonl", rows)
