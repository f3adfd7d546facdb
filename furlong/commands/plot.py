"""`furlong plot RUN_DIR [--output FILE.png]`: one PNG of a run's metrics.jsonl.

Six panels against the rollout number: training reward (mean over kept groups; with the share of
samples that called a tool when the run logs it, rollout/tool_call_ratio), held-out eval scores
(marked at each eval; the eval before training sits at rollout 0), mean and max response length,
PPO KL and clip fraction, policy entropy, and step time split into rollout, training and the rest.
Headless (the Agg backend); matplotlib is the `plot` extra.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[tuple[int, dict]]]:
    """(rollout rows by step, [(x, eval metrics)]) from RUN_DIR/metrics.jsonl; x = rollouts trained."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"furlong plot: {path} not found (is {run_dir} a run's --output-dir?)")
    rollouts: dict[int, dict] = {}
    evals: list[tuple[int, dict]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"furlong plot: {path} line {n} is not JSON ({e.msg})") from None
        ev = {k: v for k, v in row.items() if k.startswith("eval/")}
        if row.get("kind") == "eval":
            evals.append((0, ev))
            continue
        rollouts[int(row["step"])] = row          # a resumed run rewrites a step: keep the last
        if ev:
            evals.append((int(row["step"]) + 1, ev))
    if not rollouts and not evals:
        raise ValueError(f"furlong plot: {path} has no metrics")
    return [rollouts[k] for k in sorted(rollouts)], evals


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]) + 1, r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, evals = read_metrics(run_dir)
    out = Path(output) if output else Path(run_dir) / "metrics.png"
    fig, ax = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    fig.suptitle(f"furlong run: {Path(run_dir).resolve().name} ({len(rows)} rollouts)")

    def panel(a, title, ylabel, lines):
        drawn = False
        for key, label, style in lines:
            x, y = _series(rows, key)
            if x:
                a.plot(x, y, style, label=label, markersize=3)
                drawn = True
        a.set_title(title)
        a.set_xlabel("rollout")
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        if drawn:
            a.legend(fontsize=8)
        else:
            a.text(0.5, 0.5, "not logged", ha="center", va="center", transform=a.transAxes, color="gray")

    panel(ax[0, 0], "Training reward (and tool-call rate)", "mean over kept groups",
          [("rollout/raw_reward", "raw reward", "-o"), ("rollout/tool_call_ratio", "tool-call rate", "-^")])
    a = ax[0, 1]
    names = sorted({k for _, ev in evals for k in ev})
    for name in names:
        pts = [(x, ev[name]) for x, ev in evals if name in ev]
        a.plot([p[0] for p in pts], [p[1] for p in pts], "-s", markersize=6, label=name)
        for x, y in pts:
            a.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    a.set_title("Held-out eval (greedy unless configured)")
    a.set_xlabel("rollouts trained")
    a.set_ylabel("mean reward (accuracy)")
    a.grid(alpha=0.3)
    if names:
        a.legend(fontsize=8)
    else:
        a.text(0.5, 0.5, "no eval logged", ha="center", va="center", transform=a.transAxes, color="gray")
    panel(ax[0, 2], "Response length", "tokens", [("rollout/response_len/mean", "mean", "-o"),
                                                  ("rollout/response_len/max", "max", "--")])
    panel(ax[1, 0], "PPO KL and clip fraction", "per token",
          [("train/ppo_kl", "ppo_kl (old - new log-prob)", "-o"), ("train/pg_clipfrac", "clip fraction", "-^")])
    panel(ax[1, 1], "Policy entropy", "nats per token", [("train/entropy", "entropy", "-o")])
    panel(ax[1, 2], "Step time", "seconds", [("perf/step_time", "whole step", "-o"),
                                             ("perf/rollout_time", "rollout", "--"),
                                             ("perf/actor_train_time", "train", ":")])
    from matplotlib.ticker import MaxNLocator
    for a in ax.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
