"""Which checkpoint `--load` restores, checked before the run writes anything (docs/design.md §8).

A checkpoint directory counts as intact when its DCP `.metadata` reads, every
shard file it names exists and is at least as long as the last byte the
metadata places in it (a truncated copy or a crash mid-write shows up as a short
file), and `trainer.pt` and the per-rank RNG files unpickle. Only metadata and
the small trainer files are read, never the shards, so this costs milliseconds
at any model size. A damaged latest checkpoint is reported with the newest
intact earlier iteration and the flag that loads it (`--ckpt-step N`, miles'
name; alias `--load-iteration`); all iterations are kept, so one normally exists.

The model check compares the saved parameter names and shapes with those of the
--hf-checkpoint model, so another model's checkpoint is refused by name too.
"""
from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7})")


@dataclass
class CheckpointChoice:
    iteration: int                   # rollouts done when it was saved (the iter_N number)
    path: Path
    trainer_state: dict[str, Any]    # trainer.pt: scheduler, sampler, rollout_id, hf_checkpoint


def iteration_path(load_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(load_dir) / f"iter_{iteration:07d}"


def latest_iteration(save_dir: str | os.PathLike) -> int | None:
    """Iteration named by the tracker file, or None when there is no checkpoint yet."""
    tracker = Path(save_dir) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load: {tracker} does not hold an iteration number: {text!r}")
    return int(text)


def saved_iterations(load_dir: str | os.PathLike) -> list[int]:
    """The iter_N directories present (complete or not; `.tmp` ones excluded), ascending."""
    d = Path(load_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _ITER_DIR.fullmatch(p.name)) and p.is_dir())


def _read_metadata(path: Path):
    return dcp.FileSystemReader(str(path)).read_metadata()


def damage(path: Path) -> str | None:
    """Why `path` is not an intact checkpoint (module docstring), or None."""
    if not path.is_dir():
        return "no such directory"
    if not (path / ".metadata").is_file():
        return ".metadata is missing"
    try:
        meta = _read_metadata(path)
    except Exception as e:  # noqa: BLE001 - a torn pickle raises anything from EOFError to UnpicklingError
        return f".metadata is unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        if shard.stat().st_size < end:
            return f"shard {name} is truncated ({shard.stat().st_size} of {end} bytes)"
    # rank 0's RNG file is always written; other ranks' may be absent when resuming at a larger world size
    for f in [path / "trainer.pt", path / "trainer_rank0.pt", *sorted(path.glob("trainer_rank[1-9]*.pt"))]:
        if not f.is_file():
            return f"{f.name} is missing"
        try:
            torch.load(f, weights_only=False)
        except Exception as e:  # noqa: BLE001 - garbage bytes fail in many ways inside torch.load
            return f"{f.name} is unreadable ({type(e).__name__})"
    return None


def shape_mismatch(path: Path, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why the model saved in `path` is not the model with these parameter shapes, or None."""
    saved = {k[len("model."):]: v for k, v in _read_metadata(path).state_dict_metadata.items()
             if k.startswith("model.")}
    for name, shape in shapes.items():
        if name not in saved:
            return f"it has no parameter {name}"
        size = getattr(saved[name], "size", None)
        if size is not None and tuple(size) != tuple(shape):
            return f"{name} is {list(size)} there, {list(shape)} in the --hf-checkpoint model"
    extra = sorted(set(saved) - set(shapes))
    return f"it has parameter {extra[0]}, which the --hf-checkpoint model lacks" if extra else None


def _previous_intact(load_dir: str | os.PathLike, below: int) -> int | None:
    for it in reversed([i for i in saved_iterations(load_dir) if i < below]):
        if damage(iteration_path(load_dir, it)) is None:
            return it
    return None


def choose_checkpoint(load_dir: str | os.PathLike, ckpt_step: int | None,
                      shapes: dict[str, tuple[int, ...]] | None) -> CheckpointChoice:
    """The checkpoint `--load load_dir [--ckpt-step N]` restores, verified; ValueError (one line) if
    there is none, it is damaged (naming the previous intact iteration) or, when `shapes` are given,
    it is another model's (`furlong export` learns the model from the checkpoint, so checks later)."""
    if ckpt_step is None:
        if not Path(load_dir).is_dir():
            raise ValueError(f"--load: {load_dir} is not a directory")
        iteration = latest_iteration(load_dir)
        if iteration is None:
            raise ValueError(f"--load: no {TRACKER} in {load_dir}")
    else:
        iteration = ckpt_step
        if not iteration_path(load_dir, iteration).is_dir():
            have = ", ".join(map(str, saved_iterations(load_dir))) or "none"
            raise ValueError(f"--ckpt-step: no iteration {iteration} in {load_dir} (saved iterations: {have})")
    path = iteration_path(load_dir, iteration)
    why = damage(path)
    if why is not None:
        prev = _previous_intact(load_dir, iteration)
        hint = (f"; the previous intact checkpoint is {iteration_path(load_dir, prev)}: load it with "
                f"--load {load_dir} --ckpt-step {prev}" if prev is not None
                else f"; no earlier intact checkpoint in {load_dir}")
        raise ValueError(f"--load: checkpoint {path} is damaged ({why}){hint}")
    mismatch = shape_mismatch(path, shapes) if shapes is not None else None
    if mismatch is not None:
        raise ValueError(f"--load: {path} is a checkpoint of another model: {mismatch}")
    try:
        state = torch.load(path / "trainer.pt", weights_only=False)
        int(state["rollout_id"])
    except (KeyError, TypeError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"--load: {path / 'trainer.pt'} is not a furlong trainer state ({type(e).__name__})") from e
    return CheckpointChoice(iteration=iteration, path=path, trainer_state=state)
