"""Resumable checkpoints (docs/design.md §8).

Layout under `--save DIR`:
    DIR/iter_0000005/                       after rollout_id 4: a checkpoint's "iteration" counts the
                                            rollouts done (rollout_id + 1), as miles numbers them
        *.distcp, .metadata                 sharded model + optimizer (torch.distributed.checkpoint)
        trainer_rank{r}.pt                  per-rank: RNG states (torch, cuda, python, numpy)
        trainer.pt                          rank 0: scheduler, data-sampler state, rollout_id,
                                            the --hf-checkpoint trained from (for export)
    DIR/latest_checkpointed_iteration.txt   "5", written last

Crash safety: every rank writes into `iter_0000005.tmp/`; after a barrier rank 0
renames it to `iter_0000005/` and only then replaces the tracker file (temp file +
fsync + os.replace). A crash at any point leaves the tracker naming the previous,
complete checkpoint; a stale `.tmp` directory is removed by the next save.
Every iteration is kept (as in miles); `--load DIR --ckpt-step N` loads an
earlier one, and `verify.py` checks the one chosen before a run writes. `actor` below is either
trainer (the critic's checkpoints use the same functions, checkpoint/critic.py).

Model and optimizer state go through `get_state_dict`/`set_state_dict`, so the
files are keyed by parameter name (FQN) and can be loaded at another world size.
The frozen reference model is not saved: it is the initial weights, re-read from
--hf-checkpoint on resume.

Test hooks (`_test_hook`, read nowhere else): env FURLONG_CKPT_SLEEP_MID_SAVE=<seconds>
sleeps after the shards are written and before the rename, so a test can kill or
signal a save half-way; FURLONG_CKPT_FAULT=<point>:<iteration> SIGKILLs the process
at one of POINTS of that iteration's save, which no outside timing can hit exactly.
"""
from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from furlong.checkpoint.verify import TRACKER, iteration_path, latest_iteration, shape_mismatch
from furlong.launch.distributed import barrier

if TYPE_CHECKING:
    from furlong.trainer.base import Trainer

SLEEP_ENV = "FURLONG_CKPT_SLEEP_MID_SAVE"
FAULT_ENV = "FURLONG_CKPT_FAULT"
# where a save can be cut short: before it starts (the step's metrics line is already on disk), with the
# shards written but not renamed, renamed but the tracker not yet moved, and right after the tracker moved
POINTS = ("before_save", "mid_save", "before_tracker", "after_save")


@dataclass
class ResumeState:
    rollout_id: int                  # last finished rollout; training continues at rollout_id + 1
    sampler_state: dict[str, Any]    # what the caller passed as `sampler_state` to save_checkpoint
    path: str                        # the iter_* directory loaded

    @property
    def next_rollout_id(self) -> int:
        return self.rollout_id + 1


def iter_dir(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    return iteration_path(save_dir, rollout_id + 1)


def _test_hook(point: str, iteration: int) -> None:
    """The fault-injection hooks of the module docstring (tests only; unset env: nothing happens)."""
    if point == "mid_save" and float(os.environ.get(SLEEP_ENV, "0")) > 0:
        time.sleep(float(os.environ[SLEEP_ENV]))
    if os.environ.get(FAULT_ENV) == f"{point}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(save_dir: str | os.PathLike, actor: Trainer, rollout_id: int,
                    sampler_state: dict[str, Any] | None = None, source: str | None = None) -> Path:
    """Save after `rollout_id` finished; every rank must call. Returns the iter_* directory.
    `source`: the HF checkpoint the run started from, recorded so `furlong export` needs no --hf-checkpoint."""
    rank = _rank()
    _test_hook("before_save", rollout_id + 1)
    final = iter_dir(save_dir, rollout_id)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crashed save
        tmp.mkdir()
    barrier()
    try:
        model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"trainer_rank{rank}.pt")
        if rank == 0:
            torch.save({"scheduler": actor.scheduler.state_dict(), "sampler": sampler_state or {},
                        "rollout_id": rollout_id, "hf_checkpoint": source}, tmp / "trainer.pt")
    except (OSError, RuntimeError, dcp.api.CheckpointException) as e:
        raise _save_failed(e, tmp, save_dir) from e
    _test_hook("mid_save", rollout_id + 1)
    barrier()  # all shards are on disk before the directory becomes visible
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)  # re-save of the same iteration
        os.replace(tmp, final)
        _test_hook("before_tracker", rollout_id + 1)
        _write_atomic(Path(save_dir) / TRACKER, str(rollout_id + 1))
    barrier()
    _test_hook("after_save", rollout_id + 1)
    return final


class SaveError(RuntimeError):
    """A checkpoint could not be written; the previous one (if any) is untouched."""


def _save_failed(e: BaseException, tmp: Path, save_dir: str | os.PathLike) -> SaveError:
    """One line saying why the save failed (disk full named as such) and what is still intact."""
    shutil.rmtree(tmp, ignore_errors=True)     # the half-written shards would only mislead
    full = "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC
    why = "no space left on the device" if full else f"{type(e).__name__}: {e}".splitlines()[0][:200]
    last = latest_iteration(save_dir)
    kept = (f"the last complete checkpoint ({iteration_path(save_dir, last)}) is intact" if last is not None
            else "no earlier checkpoint exists")
    return SaveError(f"--save: writing {tmp} failed ({why}); {kept}")


def _check_finite(model_sd: dict[str, Any], path: Path) -> None:
    """ValueError unless every rank's loaded weights are finite (all ranks agree: one all-reduce)."""
    bad = nonfinite_tensor(model_sd.items())
    flag = torch.tensor([0 if bad is None else 1])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(next(iter(model_sd.values())).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise ValueError(f"--load: {path}: weight {bad or '(on another rank)'!r} holds NaN or inf values "
                         "(damaged checkpoint?)")


def load_checkpoint(load_dir: str | os.PathLike, actor: Trainer, iteration: int | None = None) -> ResumeState | None:
    """Restore iteration `iteration` (default: the tracker's) into `actor` (every rank calls); None if
    there is no checkpoint. Run set-up has verified it already (verify.choose_checkpoint)."""
    iteration = latest_iteration(load_dir) if iteration is None else iteration
    if iteration is None:
        return None
    path = iteration_path(load_dir, iteration)
    if not (path / "trainer.pt").exists():
        raise ValueError(f"--load: {path} is missing or incomplete (no trainer.pt)")
    try:
        meta = torch.load(path / "trainer.pt", weights_only=False)
        model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
        mismatch = shape_mismatch(path, {name: tuple(t.shape) for name, t in model_sd.items()})
        if mismatch is not None:
            raise ValueError(f"--load: {path} is a checkpoint of another model: {mismatch}")
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(actor.model, actor.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _check_finite(state["model"], path)
    except ValueError:
        raise
    except (RuntimeError, KeyError, EOFError, OSError, pickle.UnpicklingError, dcp.api.CheckpointException) as e:
        # another model's checkpoint (shape mismatch), or damaged files: one line naming the checkpoint
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise ValueError(f"--load: {path} cannot be loaded into the --hf-checkpoint model ({why})") from e
    actor.scheduler.load_state_dict(meta["scheduler"])
    rank_file = path / f"trainer_rank{_rank()}.pt"
    if rank_file.exists():  # absent when resuming at a larger world size: keep fresh RNG (rank 0's is
        # always there: checkpoint.verify refuses a checkpoint without it)
        _set_rng_state(torch.load(rank_file, weights_only=False))
    return ResumeState(rollout_id=int(meta["rollout_id"]), sampler_state=meta["sampler"], path=str(path))


def load_model_weights(load_dir: str | os.PathLike, model: torch.nn.Module, iteration: int | None = None) -> int:
    """Single process, no process group: load a checkpoint's (default: the latest) model weights
    into an unsharded `model` (export/eval). Returns the iteration loaded."""
    iteration = latest_iteration(load_dir) if iteration is None else iteration
    if iteration is None:
        raise ValueError(f"--load: no {TRACKER} in {load_dir}")
    path = iteration_path(load_dir, iteration)
    state = {"model": dict(model.state_dict())}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    missing = set(model.state_dict()) - set(state["model"])
    if missing:
        raise ValueError(f"--load: {path} lacks weights {sorted(missing)[:3]}")
    bad = nonfinite_tensor(state["model"].items())
    if bad is not None:
        raise ValueError(f"--load: {path}: weight {bad!r} holds NaN or inf values (damaged checkpoint?)")
    model.load_state_dict(state["model"])
    return iteration


def nonfinite_tensor(named: Iterable[tuple[str, Any]]) -> str | None:
    """The first floating tensor holding NaN/inf (this rank's shard of a DTensor), or None."""
    for name, t in named:
        local = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(local, torch.Tensor) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return name
    return None
