"""Process set-up for `furlong train/sft/eval`: one process, N local workers, or torchrun.

`--actor-num-gpus-per-node N` (N > 1, not under torchrun) starts N worker
processes itself; under torchrun (RANK/WORLD_SIZE set) each process is a worker.

Errors a user can cause end as ONE line on stderr and a non-zero exit, at any
world size (`exit_code_for` says which): bad input (ValueError, missing file)
exits 2, a run that cannot succeed (RolloutError: the filter keeps nothing;
CiFailure: --ci-test missed its threshold) exits 1. Anything else is a bug and
keeps its traceback. One path for every world size: `launch` runs `_worker`
here (one process or a torchrun rank; cli.main turns the error into its line),
or in N spawned workers whose errors train/distributed.launch_local classifies
with `user_error` and reports to this process, which prints the lowest rank's line. SIGINT/SIGTERM
to a process that spawned its workers is forwarded to them (launch/worker_stop.py): they stop at a safe
point or are killed after a bounded wait, and `stopped_line` is the one line; exit 128 + signal.

With several ranks, a failure on one rank reaches the others as a failed collective. Each rank's
`_worker` passes its exception to launch/failure.stop_report, which names the rank lost or failed,
the stage it was in, the last complete checkpoint and the resume command, in ONE line (RunStopped,
exit 1; no traceback unless FURLONG_DEBUG=1). --distributed-timeout-minutes bounds every collective,
so a hung peer ends the same way. --use-fault-tolerance resumes from --save by itself: --load
defaults to --save, so torchrun's restarts (--max-restarts N) continue from the last checkpoint.
"""
from __future__ import annotations

import errno
import functools
import os
import sys
from typing import TYPE_CHECKING, Callable

from furlong.config import Config

if TYPE_CHECKING:   # furlong.types imports torch, which `furlong --help` need not load
    from furlong.launch.failure import Position
    from furlong.launch.worker_stop import WorkersStopped
    from furlong.run.user_functions import UserFunctions
    from furlong.types import DistContext

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
_WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG)


def _run_failure_types() -> tuple[type, ...]:
    """RolloutError, CiFailure and RewardError, imported only when an error is being classified."""
    from furlong.run.loop import CiFailure
    from furlong.rewards.registry import RewardError
    from furlong.rollout.rollout import RolloutError
    from furlong.checkpoint.store import SaveError
    from furlong.launch.failure import RunStopped
    from furlong.trainer.nonfinite import NonFiniteError
    from furlong.rollout.filters import FilterError
    from furlong.trainer.memory_plan import TrainerOutOfMemory
    return (RolloutError, CiFailure, RewardError, SaveError, NonFiniteError, FilterError, RunStopped, TrainerOutOfMemory)


def exit_code_for(e: BaseException) -> int | None:
    """Exit code for an error the user caused, or None for a bug (which keeps its traceback)."""
    if isinstance(e, (ValueError, FileNotFoundError)):
        return EXIT_BAD_INPUT
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:   # full disk, read-only target: one line
        return EXIT_RUN_FAILED
    try:
        failures = _run_failure_types()
    except Exception:  # noqa: BLE001 - a broken import must not hide the original error
        return None
    return EXIT_RUN_FAILED if isinstance(e, failures) else None


def error_line(e: BaseException) -> str:
    """The one stderr line for a user error: its message's first line."""
    text = str(e).strip()
    return f"furlong: error: {text.splitlines()[0] if text else type(e).__name__}"


def user_error(e: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for an error the user caused, None for a bug."""
    code = exit_code_for(e)
    return None if code is None else (code, error_line(e))


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_train(cfg: Config, ctx: DistContext, position: Position, user: UserFunctions | None = None) -> int:
    from furlong.run.loop import run_rl
    return run_rl(cfg, ctx, position, user)


def _run_sft(cfg: Config, ctx: DistContext, position: Position) -> int:
    from furlong.commands.sft import run_sft
    return run_sft(cfg, ctx)


def _run_eval(cfg: Config, ctx: DistContext, position: Position) -> int:
    from furlong.run.loop import run_eval_only
    return run_eval_only(cfg, ctx)


# command -> what every rank runs, given the Config, its DistContext and its Position (docs/design.md §4)
RUNS: dict[str, Callable[[Config, DistContext, Position], int]] = {
    "train": _run_train, "sft": _run_sft, "eval": _run_eval}


def _worker(command: str, cfg: Config, user: UserFunctions | None = None) -> int:
    """One rank: join (or form) the process group, run, leave. Errors propagate to the caller:
    cli.main in this process, or launch_local's worker wrapper in a spawned one; with several
    ranks, as the RunStopped line of failure.stop_report (unless the rank's own user error)."""
    from furlong.launch.distributed import destroy_distributed, init_distributed
    from furlong.launch.failure import RunStopped, open_position, record_for_torchrun, stop_report
    ctx = init_distributed(cfg.parallel.device, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    position = open_position(ctx.rank, ctx.world_size)
    try:
        run = RUNS[command] if user is None else functools.partial(RUNS[command], user=user)   # api.py: train
        return run(cfg, ctx, position)
    except Exception as e:
        if ctx.world_size == 1 or isinstance(e, RunStopped):
            raise
        known = user_error(e)
        line = stop_report(e, position, ctx.world_size, cfg, command, known[1] if known else None)
        record_for_torchrun(line)
        if known is not None:
            raise
        raise RunStopped(line) from None
    finally:
        destroy_distributed()


def stopped_line(command: str, cfg: Config, e: WorkersStopped) -> str | None:
    """The launcher's one line for a signalled run of spawned workers; None when rank 0's step loop
    already printed "stopped by signal N after rollout K" (the line a single process prints)."""
    import signal
    from furlong.launch.failure import last_complete_checkpoint
    from furlong.termination import Terminated, terminated_line
    if e.num_killed:
        path = last_complete_checkpoint(cfg.ckpt.save)
        kept = ("no checkpoint (no --save)" if cfg.ckpt.save is None else f"last complete checkpoint: {path}"
                if path is not None else f"no complete checkpoint in {cfg.ckpt.save}")
        return (f"furlong {command}: stopped by signal {e.signum} ({signal.Signals(e.signum).name}); "
                f"{e.num_killed} worker(s) had not stopped {e.grace_s:g}s later and were killed; {kept}")
    if e.workers_printed:
        return None
    # a worker's own line (it stopped outside a step), else the same words for workers that were
    # stopped before they could say anything (still starting) or failed as their peers left
    return e.worker_line or terminated_line(Terminated(e.signum))


def launch(command: str, cfg: Config, user: UserFunctions | None = None) -> int:
    """Run `command` here (one process, or one torchrun rank) or in N local workers; `user`: the Python
    API's callables (train only; spawned workers need them picklable)."""
    if cfg.parallel.use_fault_tolerance and cfg.ckpt.load is None:
        cfg.ckpt.load = cfg.ckpt.save   # a restarted worker resumes from the run's own checkpoints
    n = cfg.parallel.actor_num_gpus_per_node
    if cfg.parallel.actor_num_nodes > 1 and not _under_torchrun():
        raise ValueError("--actor-num-nodes: runs over several nodes are launched with "
                         "`torchrun --nnodes ... -m furlong train ...`")
    if n > 1 and not _under_torchrun():
        from furlong.launch.distributed import WorkerError, launch_local
        from furlong.launch.worker_stop import WorkersStopped
        try:
            return launch_local(_worker, n, command, cfg, user, describe=user_error)
        except WorkersStopped as e:   # this launcher got SIGINT/SIGTERM (launch/worker_stop.py)
            line = stopped_line(command, cfg, e)
            if line is not None:
                print(line, file=sys.stderr)
            return 128 + e.signum
        except WorkerError as e:
            # a user error is its own line; a bug printed its traceback in the worker, and this
            # is the line that matters
            print(e.line if e.user_error else f"furlong {command}: error: {e}", file=sys.stderr)
            return e.code if e.user_error else EXIT_RUN_FAILED
    return _worker(command, cfg, user)


# `furlong <command>` -> its entry point (cli.py)
COMMANDS: dict[str, Callable[[Config], int]] = {name: functools.partial(launch, name) for name in RUNS}
