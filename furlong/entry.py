"""Process set-up for `furlong train/sft/eval`: one process, N local workers, or torchrun.

`--actor-num-gpus-per-node N` (N > 1, not under torchrun) starts N worker
processes itself; under torchrun (RANK/WORLD_SIZE set) each process is a worker.

Errors a user can cause end as ONE line on stderr and a non-zero exit, at any
world size (`exit_code_for` says which): bad input (ValueError, missing file)
exits 2, a run that cannot succeed (RolloutError: the filter keeps nothing;
CiFailure: --ci-test missed its threshold) exits 1. Anything else is a bug and
keeps its traceback. With local workers, a worker that hits such an error puts
(rank, exit code, line) on a queue and leaves at once with `os._exit`, so the
launcher prints no traceback; the parent prints the first rank's line.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from furlong.config import Config

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1


def _run_failure_types() -> tuple[type, ...]:
    """RolloutError, CiFailure and RewardError, imported only when an error is being classified."""
    from furlong.loop import CiFailure
    from furlong.rewards.registry import RewardError
    from furlong.rollout.rollout import RolloutError
    from furlong.train.checkpoint import SaveError
    return (RolloutError, CiFailure, RewardError, SaveError)


def exit_code_for(e: BaseException) -> int | None:
    """Exit code for an error the user caused, or None for a bug (which keeps its traceback)."""
    if isinstance(e, (ValueError, FileNotFoundError)):
        return EXIT_BAD_INPUT
    try:
        failures = _run_failure_types()
    except Exception:  # noqa: BLE001 - a broken import must not hide the original error
        return None
    return EXIT_RUN_FAILED if isinstance(e, failures) else None


def error_line(e: BaseException) -> str:
    """The one stderr line for a user error: its message's first line."""
    text = str(e).strip()
    return f"furlong: error: {text.splitlines()[0] if text else type(e).__name__}"


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _worker(kind: str, cfg: Config, errors: Any = None) -> int:
    """One rank's run. `errors`: the launcher's queue for one-line user errors (local workers only)."""
    from furlong.train.distributed import destroy_distributed, init_distributed
    try:
        ctx = init_distributed(cfg.parallel.device)
        try:
            if kind == "train":
                from furlong.loop import run_rl
                return run_rl(cfg, ctx)
            if kind == "sft":
                from furlong.sft import run_sft
                return run_sft(cfg, ctx)
            from furlong.loop import run_eval_only
            return run_eval_only(cfg, ctx)
        finally:
            destroy_distributed()
    except Exception as e:
        code = exit_code_for(e)
        if errors is None or code is None:
            raise
        errors.put((int(os.environ.get("RANK", "0")), code, error_line(e)))
        sys.stdout.flush()
        os._exit(code)   # no launcher traceback; the parent reports the line and stops the others


def _launch(kind: str, cfg: Config) -> int:
    n = cfg.parallel.actor_num_gpus_per_node
    if cfg.parallel.actor_num_nodes > 1 and not _under_torchrun():
        raise ValueError("--actor-num-nodes: runs over several nodes are launched with "
                         "`torchrun --nnodes ... -m furlong train ...`")
    if n > 1 and not _under_torchrun():
        import multiprocessing as mp

        from furlong.train.distributed import WorkerError, launch_local
        errors = mp.get_context("spawn").SimpleQueue()
        try:
            code = launch_local(_worker, n, kind, cfg, errors)
        except WorkerError as e:
            reports = []
            while not errors.empty():
                reports.append(errors.get())
            if reports:
                _, code, line = min(reports)   # lowest rank: all ranks usually fail alike
                print(line, file=sys.stderr)
                return code
            # a bug in a worker: it printed its traceback; this is the line that matters
            print(f"furlong {kind}: error: {e}", file=sys.stderr)
            return EXIT_RUN_FAILED
        return code
    return _worker(kind, cfg)


def train(cfg: Config) -> int:
    return _launch("train", cfg)


def sft(cfg: Config) -> int:
    return _launch("sft", cfg)


def evaluate(cfg: Config) -> int:
    return _launch("eval", cfg)


COMMANDS: dict[str, Callable[[Config], int]] = {"train": train, "sft": sft, "eval": evaluate}
