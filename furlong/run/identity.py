"""Which run a run directory and a checkpoint directory belong to: a run id in each.

A new run (no --load) gets a fresh id; a resumed run keeps the id its --load directory records.
The id is written to `run_id.txt` in --output-dir and in --save, so that a directory never mixes
two runs silently:
- --output-dir holding metrics.jsonl: refused for a new run unless --overwrite (which starts the
  metrics and the samples/ dumps over); refused on --load when it records ANOTHER run's id,
  unless --overwrite;
- --save holding checkpoints (the tracker or iter_* directories) that are not the --load run's:
  refused unless --overwrite, which removes the old run's iter_* directories and tracker (the
  critic's beside them too), so that `--ckpt-step N` can never pick up the old run later.
Directories written before run ids existed carry none; they are treated as the --load run's.
Only files furlong names are removed (metrics.jsonl, samples/{eval,rollout}_*.jsonl, iter_NNNNNNN
and their .tmp, the tracker, run_id.txt); anything else in the directories stays.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from furlong.checkpoint.verify import TRACKER

RUN_ID_FILE = "run_id.txt"
_CKPT_ENTRY = re.compile(r"iter_\d{7}(\.tmp)?")
_SAMPLES = re.compile(r"(eval|rollout)_.+\.jsonl")


def read_run_id(d: str | os.PathLike | None) -> str | None:
    f = Path(d) / RUN_ID_FILE if d is not None else None
    return f.read_text().strip() or None if f is not None and f.is_file() else None


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


def _holds_checkpoints(d: Path) -> bool:
    return d.is_dir() and ((d / TRACKER).exists() or any(_CKPT_ENTRY.fullmatch(p.name) for p in d.iterdir()))


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


@dataclass
class RunDirs:
    """The checked plan for a run's directories (plan_run_dirs); applied by prepare_run_dirs."""
    run_id: str
    output_dir: Path
    save_dirs: list[Path] = field(default_factory=list)   # --save (and the critic's): get the run id
    clear_metrics: bool = False                           # metrics.jsonl and samples/ start over
    clear_saves: list[Path] = field(default_factory=list)   # old runs' checkpoints to remove


def plan_run_dirs(output_dir: Path, saves: list[tuple[str, str, str | None]], load: str | None,
                  overwrite: bool) -> RunDirs:
    """Check --output-dir and the save directories against the run (module docstring); nothing is
    written. `saves`: (flag, save directory, the directory that flag's run resumes from) for --save
    and, with a critic, --critic-save."""
    load_id = read_run_id(load)
    plan = RunDirs(run_id=load_id or new_run_id(), output_dir=output_dir, save_dirs=[Path(s) for _, s, _ in saves])
    out_id = read_run_id(output_dir)
    if (output_dir / "metrics.jsonl").exists():
        if load is None and not overwrite:
            raise ValueError(f"--output-dir: {output_dir} already holds a run (metrics.jsonl); pass --load to "
                             "continue it or --overwrite to replace it")
        other = load is not None and out_id is not None and load_id is not None and out_id != load_id
        if other and not overwrite:
            raise ValueError(f"--output-dir: {output_dir} holds run {out_id}, but --load {load} is run {load_id}; "
                             "give that run's own --output-dir, a new one, or --overwrite to start its metrics over")
        plan.clear_metrics = load is None or other
    for flag, save, resumed_from in saves:
        d = Path(save)
        if _same(save, resumed_from) or not _holds_checkpoints(d):
            continue
        save_id = read_run_id(d)
        if load is not None and save_id is not None and save_id == load_id:
            continue
        if not overwrite:
            whose = f"of run {save_id}" if save_id else "of another run"
            raise ValueError(f"{flag}: {d} already holds checkpoints {whose}; pass --load {d} to continue that run, "
                             "another directory, or --overwrite to remove them")
        plan.clear_saves.append(d)
    return plan


def _remove_matching(d: Path, pattern: re.Pattern) -> None:
    if not d.is_dir():
        return
    for p in d.iterdir():
        if pattern.fullmatch(p.name):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def prepare_run_dirs(plan: RunDirs) -> None:
    """Rank 0, after every input check: clear what the plan says and write the run id everywhere."""
    out = plan.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if plan.clear_metrics:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        _remove_matching(out / "samples", _SAMPLES)
    for d in plan.clear_saves:
        _remove_matching(d, _CKPT_ENTRY)
        (d / TRACKER).unlink(missing_ok=True)
    (out / RUN_ID_FILE).write_text(plan.run_id + "\n")
    for d in plan.save_dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / RUN_ID_FILE).write_text(plan.run_id + "\n")


def run_record(cfg, run_id: str) -> dict:
    """config.json: the flags, with what made the run (furlong version, command line) and its id."""
    import shlex
    import sys

    import furlong
    return {"furlong_version": furlong.__version__, "command_line": shlex.join(["furlong", *sys.argv[1:]]),
            "run_id": run_id, **cfg.to_dict()}
