"""Process-group setup for the data-parallel trainer (docs/design.md §4).

Three ways a trainer process comes to life:
  * torchrun (multi-node): RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are
    set; `init_distributed` joins the group they describe.
  * `launch_local(fn, N)` (`--actor-num-gpus-per-node N`): this module spawns N
    workers itself, on a free local port, and sets the same variables.
  * plain single process: no env vars; a one-rank group on a private port, so
    FSDP2 wraps the model the same way at every world size (one code path).

Backend: nccl on CUDA, gloo on CPU. `all_reduce_max` reduces
several Python numbers with ONE collective (stacked into one tensor) and one
host copy; `all_gather_flat` gathers variable-length 1-D results in one call.

A failing worker (any exception, or SystemExit with a non-zero code) puts its
exit code and one line on a queue and exits; launch_local then stops the other
workers and raises WorkerError with the lowest failing rank's report. The caller's
`describe` says which exceptions are user errors (one line, their own exit code,
no traceback); any other exception is a bug: its traceback is printed and the
line is "Type: first line of message". This is the one error path of spawned
workers (entry.py supplies `describe`).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import socket
import sys
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from furlong.launch.worker_stop import STOP_GRACE_S, STOPPED_CODES, ParentStop, exit_with_parent
from furlong.types import DistContext


def _resolve_device_type(device_pref: str) -> str:
    if device_pref not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device: unknown device {device_pref!r} (auto, cpu, cuda)")
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but CUDA is not available")
    if device_pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device_pref


def init_distributed(device_pref: str = "auto", timeout_minutes: float | None = None) -> DistContext:
    """Join the process group described by torchrun-style env vars, or run alone. `timeout_minutes`
    (--distributed-timeout-minutes) bounds every collective of the group and the rendezvous; None keeps
    torch's default."""
    device_type = _resolve_device_type(device_pref)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
        if timeout_minutes is not None:
            kwargs["timeout"] = datetime.timedelta(minutes=timeout_minutes)
        if "MASTER_ADDR" not in os.environ:
            # single process: a one-rank group on a private port, so the trainer
            # has one code path (FSDP2/DTensor) for any world size
            kwargs["init_method"] = f"tcp://127.0.0.1:{free_port()}"
        elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
            kwargs["store"] = _attempt_store(rank, kwargs.get("timeout"))
        if device_type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init bound to this rank's GPU
            # On a timeout NCCL's watchdog aborts the communicators and the waiting call raises (2,
            # "CleanUpOnly"), instead of tearing the process down from the watchdog thread (torch's
            # default), so the rank reaches its one-line report (failure.py).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(**kwargs)
    else:  # joined earlier in this process: report the group's actual shape
        rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def _attempt_store(rank: int, timeout: datetime.timedelta | None) -> dist.Store:
    """Under torchrun: a client of the agent's store, its keys under this restart attempt's prefix.
    With the static rendezvous (--master-addr/--master-port) the agent keeps one store across
    --max-restarts, so a restarted worker would otherwise read the addresses its dead predecessors
    published and hang connecting to them; every node's agent counts the same restarts, since a
    failure stops the workers of every node (launch/failure.py). Without the agent's store (a
    rendezvous that does not share it), rank 0 serves one, as torch's env:// set-up does."""
    host_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host_it,
                          timeout=timeout or datetime.timedelta(minutes=10))
    return dist.PrefixStore(f"furlong/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _reduce(values: Sequence[float], op: Any, device: torch.device | None) -> list[float]:
    vals = [float(v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return vals
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # float64 keeps integer token counts exact up to 2**53
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()  # host sync: the caller needs the numbers (one per call, by design)


def all_reduce_max(values: Sequence[float], device: torch.device | None = None) -> list[float]:
    """Max of each value over ranks with one collective."""
    return _reduce(values, dist.ReduceOp.MAX, device)


def all_gather_flat(local: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Gather each rank's 1-D `local` (rank r holds sizes[r] elements, known to all ranks)
    with one collective; returns the per-rank tensors on the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local.detach().cpu()]
    width = max(max(sizes), 1)
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local
    bufs = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded)
    host = torch.stack(bufs).cpu()  # one device-to-host copy for all ranks
    return [host[r, :n] for r, n in enumerate(sizes)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerError(RuntimeError):
    """A spawned worker failed: `line` is its one-line report, `code` its exit code, and
    `user_error` whether `describe` classified it (else it is a bug, traceback already printed)."""

    def __init__(self, rank: int, code: int, line: str, user_error: bool = False):
        super().__init__(f"rank {rank}: {line}")
        self.rank, self.code, self.line, self.user_error = rank, code, line, user_error


# describe(exception) -> (exit code, one line) for a user error, None for a bug
Describe = Callable[[BaseException], "tuple[int, str] | None"]


def _spawned(local_rank: int, num_procs: int, port: int, fn: Callable[..., Any], args: tuple, err_q: Any,
             describe: Describe | None) -> None:
    from furlong.termination import Terminated, sigterm_raises, terminated_line
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(num_procs),
        "LOCAL_WORLD_SIZE": str(num_procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    if "OMP_NUM_THREADS" not in os.environ:
        # N workers share this host's cores (torchrun does the same by default)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_procs))
    exit_with_parent()
    try:
        with sigterm_raises():   # outside a step loop, the launcher's forwarded SIGTERM is one line too
            result = fn(*args)
    except (Terminated, KeyboardInterrupt) as e:   # asked to stop (worker_stop.py): a line, no traceback
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = 128 + e.signum if isinstance(e, Terminated) else 128 + signal.SIGINT
        err_q.put((local_rank, code, terminated_line(e) if isinstance(e, Terminated) else "furlong: interrupted",
                   True))
        sys.stdout.flush()
        # no destroy_distributed: a peer may sit in a collective that would hold this exit up
        os._exit(code)
    except BaseException as e:  # report every failure, including SystemExit from validation
        code = e.code if isinstance(e, SystemExit) else 1
        if isinstance(e, SystemExit) and code in (0, None):
            return
        known = describe(e) if describe is not None and isinstance(e, Exception) else None
        if known is not None:
            code, line = known
        else:
            traceback.print_exc()
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            line = f"{type(e).__name__}: {msg}"
        err_q.put((local_rank, code if isinstance(code, int) else 1, line, known is not None))
        sys.stdout.flush()
        destroy_distributed()
        # skip interpreter teardown of a half-failed group; the launcher prints the one-line error
        os._exit(code if isinstance(code, int) else 1)
    # Every rank reaches the end before any tears the group down (a rank still writing results
    # must not find its peers' sockets gone).
    barrier()
    destroy_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a spawned child otherwise runs C++ static destructors, and a
    # still-joinable library thread there aborts the process ("terminate called without an
    # active exception", exit -6) now and then, long after the work succeeded. Files the worker
    # wrote are closed by then (no furlong code relies on atexit).
    os._exit(result if isinstance(result, int) and result >= 128 else 0)  # >= 128: stopped by a signal (signals.py)


def launch_local(fn: Callable[..., Any], num_procs: int, *args: Any, describe: Describe | None = None,
                 stop_grace_s: float = STOP_GRACE_S) -> int:
    """Run `fn(*args)` in `num_procs` fresh (spawned) processes forming one process group.

    `fn` must be picklable (module-level). When a worker fails, the others are
    terminated and WorkerError carries the lowest failing rank's report (see the
    module docstring for `describe`).
    SIGINT/SIGTERM to this launcher are forwarded (as SIGTERM) to the workers, which stop after
    their current step (signals.py); workers still running `stop_grace_s` later are killed, and
    WorkersStopped says how the run ended (worker_stop.py). Returns the workers' largest exit code.
    Plain multiprocessing rather than torch.multiprocessing.start_processes: the
    latter's exit path costs seconds per launch, which the CPU tests feel.
    """
    if num_procs < 1:
        raise ValueError("--actor-num-gpus-per-node: must be >= 1")
    ctx = mp.get_context("spawn")
    err_q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, num_procs, port, fn, args, err_q, describe), daemon=False)
             for r in range(num_procs)]
    stop = ParentStop(procs, stop_grace_s)
    failed, alive, num_killed = None, list(procs), 0
    with stop.installed():
        try:
            for p in procs:
                p.start()
            stop.forward()   # a signal that came while the workers were starting reaches them all
            # Once a stop is asked for, a worker failing (its peer left a collective) no longer ends the
            # wait: every worker gets its grace to stop and save.
            while alive and (failed is None or stop.signum is not None) and not stop.expired():
                mp_connection.wait([p.sentinel for p in alive], timeout=stop.wait_timeout())
                for p in list(alive):
                    if p.exitcode is not None:
                        alive.remove(p)
                        if p.exitcode not in (0, *STOPPED_CODES) and failed is None:
                            failed = p
        finally:
            if stop.signum is not None:
                num_killed = stop.kill(alive)
            # A failed rank leaves the others blocked in collectives: SIGKILL, since SIGTERM would only
            # start their stop-at-a-safe-point path (the run has failed; saves are atomic anyway).
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join()
    reports = []
    while not err_q.empty():
        reports.append(err_q.get())
    stopped = stop.outcome(reports, num_killed)
    if stopped is not None:
        raise stopped
    if failed is not None:
        # A user error first (the lowest rank's: ranks usually fail alike), else the first report
        # queued: the ranks that failed after it may have failed only because it went away. A stop
        # line (a rank SIGTERMed from outside) says nothing about the failure.
        reports = [r for r in reports if r[1] < 128] or reports
        chosen = min((r for r in reports if r[3]), default=None) or (reports[0] if reports else None)
        if chosen is not None:
            raise WorkerError(*chosen)
        raise WorkerError(procs.index(failed), failed.exitcode, f"exited with code {failed.exitcode}")
    return max(p.exitcode for p in procs)
