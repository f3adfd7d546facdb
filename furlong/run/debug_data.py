"""miles' debugging modes: rollouts without training, training on saved rollouts, and the dumps.

  --debug-rollout-only      no trainer is built (run/setup.py: no trainer model, optimizer, reference
                            or critic, so a model too big to train can be rolled out) and each step stops
                            after the rollout (no weight sync, no checkpoint); the engine loads the
                            weights of --hf-checkpoint itself. With --save-debug-rollout-data it records
                            rollouts. Deviation from miles, which ignores --load here: a --load checkpoint
                            gives the engine its trained weights and the prompt sampler its position, so
                            the rollouts are those a resumed run would make next.
  --save-debug-rollout-data TEMPLATE   each training rollout's samples to TEMPLATE.format(rollout_id=k)
                            (miles' form; eval samples to rollout_id eval_<k>). Deviation from miles: the
                            file is furlong's JSONL below whatever the suffix, not miles' .pt pickle. Bare
                            (furlong's older form): <output-dir>/samples/rollout_train_<k+1>.jsonl.
  --load-debug-rollout-data the rollout stage reads rollout k's samples back instead of generating
                            (implies --debug-train-only: no weight sync into the engine, no eval, as
                            miles); the rest of the step is the live one, so a replay of a live run's
                            rollouts trains exactly as that run did (same seed). Its argument: a run
                            directory written with --save-debug-rollout-data (samples/rollout_train_<k+1>
                            .jsonl) or --dump-details (rollout_data/<k>.jsonl), or a path template with
                            {rollout_id} (what --save-debug-rollout-data TEMPLATE wrote).
  --save-debug-train-data   torch.save of each rollout's TrainSamples (tokens, advantages, log-probs,
                            masks, values/returns) to the template's {rollout_id}, {rank} path.
  --dump-details DIR        DIR/rollout_data/{rollout_id}.jsonl and DIR/train_data/{rollout_id}_{rank}.pt
                            (miles' layout; the rollout file is furlong's JSONL, not miles' .pt).

A rollout file holds one JSON object per sample: the readable fields (prompt, response, label, reward,
finish_reason) and what training needs back (token ids, engine log-probs, loss mask, group and index,
metadata). Files are written whole (temporary file, then rename).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from furlong.config_field import RUN_DIR_SAMPLES
from furlong.types import Group, Prompt, Sample, TrainSample

FLAG = "--load-debug-rollout-data"


@dataclass(frozen=True)
class DebugConfig:
    rollout_only: bool = False
    train_only: bool = False               # --debug-train-only, or implied by load_rollout_data
    load_rollout_data: str | None = None   # run dir, dump dir, or a path template with {rollout_id}
    save_rollout_data: str | None = None   # path template with {rollout_id} (--save-debug-rollout-data TEMPLATE,
                                           # --dump-details)
    save_train_data: str | None = None     # path template with {rollout_id} and {rank}


def debug_config(cfg: Any) -> DebugConfig:
    d = cfg.debug
    dump = d.dump_details.rstrip("/") if d.dump_details is not None else None
    train = d.save_debug_train_data or (f"{dump}/train_data/{{rollout_id}}_{{rank}}.pt" if dump else None)
    template = cfg.log.save_debug_rollout_data if cfg.log.save_debug_rollout_data != RUN_DIR_SAMPLES else None
    return DebugConfig(rollout_only=d.debug_rollout_only,
                       train_only=d.debug_train_only or d.load_debug_rollout_data is not None,
                       load_rollout_data=d.load_debug_rollout_data,
                       # --dump-details wins over a template, as in miles (a start-up note says so)
                       save_rollout_data=f"{dump}/rollout_data/{{rollout_id}}.jsonl" if dump else template,
                       save_train_data=train)


def save_rollout_rows(template: str, rollout_id: int | str, samples: list[Sample]) -> None:
    """The samples to the template's path (rollout_id: an int for a training rollout, "eval_<id>" for an
    eval, as miles names them)."""
    write_rows(Path(template.format(rollout_id=rollout_id)), [sample_row(s) for s in samples])


def sample_row(s: Sample) -> dict[str, Any]:
    return {"prompt": s.prompt.text, "response": s.response_text, "label": s.prompt.label, "reward": s.reward,
            "finish_reason": s.finish_reason, "group_id": s.group_id, "index": s.index,
            "prompt_row": s.prompt.row, "prompt_raw": s.prompt.raw, "prompt_token_ids": s.prompt.token_ids,
            "prompt_metadata": s.prompt.metadata, "response_ids": s.response_ids,
            "rollout_log_probs": s.rollout_log_probs, "loss_mask": s.loss_mask, "metadata": s.metadata}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
    os.replace(tmp, path)


def rollout_data_path(source: str, rollout_id: int) -> Path:
    """The file of rollout `rollout_id` (0-based) under `source` (module docstring); ValueError naming
    the flag when there is none."""
    if "{rollout_id}" in source:
        candidates = [Path(source.format(rollout_id=rollout_id))]
    else:
        candidates = [Path(source) / "samples" / f"rollout_train_{rollout_id + 1}.jsonl",
                      Path(source) / "rollout_data" / f"{rollout_id}.jsonl"]
    for p in candidates:
        if p.is_file():
            return p
    raise ValueError(f"{FLAG}: no saved rollout {rollout_id + 1} ({' or '.join(str(p) for p in candidates)}); "
                     "save one with --save-debug-rollout-data or --dump-details")


def _sample(row: dict[str, Any]) -> Sample:
    prompt = Prompt(row=int(row["prompt_row"]), raw=row["prompt_raw"], text=row["prompt"],
                    token_ids=[int(t) for t in row["prompt_token_ids"]], label=row["label"],
                    metadata=dict(row["prompt_metadata"]))
    return Sample(prompt=prompt, group_id=int(row["group_id"]), index=int(row["index"]),
                  response_ids=[int(t) for t in row["response_ids"]], response_text=row["response"],
                  rollout_log_probs=[float(x) for x in row["rollout_log_probs"]],
                  finish_reason=row["finish_reason"], reward=float(row["reward"]), loss_mask=row["loss_mask"],
                  metadata=dict(row["metadata"]))


def load_rollout_groups(source: str, rollout_id: int) -> list[Group]:
    """Rollout `rollout_id`'s groups as saved: samples grouped by group id in file order."""
    path = rollout_data_path(source, rollout_id)
    data = path.read_bytes()
    if data[:2] == b"PK" or data[:1] == b"\x80":   # torch.save's zip, or a bare pickle
        raise ValueError(f"{FLAG}: {path} is a pickle (miles' .pt rollout dump?); furlong replays only its own "
                         "JSONL rollout files, written by furlong's --save-debug-rollout-data or --dump-details")
    groups: dict[int, list[Sample]] = {}
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            s = _sample(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{FLAG}: {path} line {n} is not a saved sample with token ids ({type(e).__name__}: "
                             f"{e}); it must come from --save-debug-rollout-data or --dump-details") from None
        groups.setdefault(s.group_id, []).append(s)
    if not groups:
        raise ValueError(f"{FLAG}: {path} holds no samples")
    return [Group(group_id=g, samples=samples) for g, samples in groups.items()]


def save_train_data(template: str, rollout_id: int, rank: int, samples: list[TrainSample]) -> None:
    """torch.save({"rollout_id", "samples": [TrainSample fields]}) to the template's path, written whole."""
    path = Path(template.format(rollout_id=rollout_id, rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"rollout_id": rollout_id, "samples": [dataclasses.asdict(s) for s in samples]}, tmp)
    os.replace(tmp, path)


def replay_batch(source: str, rollout_id: int) -> Any:
    """The saved rollout as the rollout stage's RolloutBatch (every rank reads the whole file, as every
    rank holds all groups after a live rollout); the engine's perf counters are left out."""
    import time
    from furlong.engine.stats import EngineStats
    from furlong.rollout.rollout import RolloutBatch
    from furlong.rollout.rollout_metrics import summarize
    started = time.perf_counter()
    groups = load_rollout_groups(source, rollout_id)
    idle = EngineStats()   # no engine ran: every counter 0
    metrics = summarize(groups, {}, 0, len(groups), 0, time.perf_counter() - started, 0.0, idle)
    metrics.engine = {}
    return RolloutBatch(groups=groups, metrics=metrics)
