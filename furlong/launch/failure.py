"""Where each rank is in the run, and the one line a multi-rank run ends with when a rank is lost.

The loop enters `with position.stage(name, rollout_id):` for each stage of a step; the Position keeps the
name and, in a run of several ranks, publishes "node stage rollout_id" under `furlong/pos/<rank>` in
the process group's store (the TCPStore of the rendezvous; torchrun's agent hosts it, so it outlives
any worker). When a rank fails, `stop_report` (called by launch/entry.py on every rank) turns the
exception into one line:

  * a rank that raised (bad input, a bug, ...) publishes its own line under `furlong/raised/<rank>`
    before it exits, and prints it;
  * a rank whose collective failed (a peer's socket closed, a timeout of --distributed-timeout-minutes)
    publishes `furlong/survived/<rank>`, then waits up to GRACE_S for every other rank to publish one
    of the two keys. A rank that raised is named with its line; otherwise the ranks that stayed silent
    are the lost ones (killed, or hung past the timeout: the two look alike from outside), named with
    the stage they last published: `rank 1 (node 1) stopped during the train step of rollout 3`.

The line ends with the last complete checkpoint (checkpoint/verify.py's intactness check) and the
command that resumes from it. No traceback is printed unless FURLONG_DEBUG=1. The store may be gone
too (its host died): every store call is guarded, and the line then names only this rank's own view.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

DEBUG_ENV = "FURLONG_DEBUG"
GRACE_S = 5.0        # how long a survivor waits for the other ranks to report before calling them lost
# stage name the loop passes -> how the line says it ("the train step of rollout 3")
STAGE_WORDS = {"rollout": "generation", "shaping": "reward shaping", "old_log_probs": "old log-prob pass",
               "ref_log_probs": "reference log-prob pass", "values": "critic's value pass",
               "advantages": "advantage step", "critic_train": "critic train step", "actor_train": "train step",
               "update_weights": "weight sync", "eval": "eval", "save": "checkpoint save"}
# text of collective errors that come as plain RuntimeError (gloo's transport, NCCL's watchdog)
_COLLECTIVE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                       "timed out", "NCCL", "gloo", "Socket Timeout")


class RunStopped(RuntimeError):
    """A run of several ranks stopped; the message is the one line (entry.py exits 1 with it)."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe_stage(stage: str, rollout_id: int | None) -> str:
    if rollout_id is None:
        return stage
    return f"the {STAGE_WORDS.get(stage, stage)} of rollout {rollout_id + 1}"


@dataclass
class Position:
    """This rank's place in the run: which stage of which rollout (`rollout_id` 0-based; None outside steps)."""
    rank: int = 0
    node: int = 0
    current: str = "set-up"      # the stage last entered
    rollout_id: int | None = None
    store: Any = field(default=None, repr=False)   # the process group's store; None when alone

    @contextmanager
    def stage(self, stage: str, rollout_id: int | None = None) -> Iterator[None]:
        """`with position.stage("actor_train", rollout_id):` marks the stage; left as is on exit, so a
        failure after it (logging, the progress line) still names the last stage entered."""
        self.current, self.rollout_id = stage, rollout_id
        if self.store is not None:
            # one small TCPStore write per stage (about 6 per step), not per micro-batch
            _try(self.store.set, f"furlong/pos/{self.rank}", f"{self.node} {stage} {rollout_id}")
        yield

    def here(self) -> str:
        return describe_stage(self.current, self.rollout_id)


_FAILED = object()


def _try(fn, *args) -> Any:
    """A store call that must not raise (the store's host may be the rank that died); _FAILED if it did."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - any store failure means "no answer"
        return _FAILED


def node_of(rank: int) -> int:
    """torchrun numbers ranks node by node, LOCAL_WORLD_SIZE per node."""
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def open_position(rank: int, world_size: int) -> Position:
    """The Position of this rank; it publishes to the default group's store when there are peers."""
    node = int(os.environ.get("GROUP_RANK", node_of(rank)))
    store = None
    if world_size > 1:
        from torch.distributed import distributed_c10d
        store = _try(distributed_c10d._get_default_store)
        store = None if store is _FAILED else store
    pos = Position(rank=rank, node=node, store=store)
    with pos.stage("set-up"):
        pass
    return pos


def is_collective_failure(e: BaseException) -> bool:
    """A collective (or the store) failed: a peer went away or a timeout ran out. torch raises DistError
    for most; gloo's transport errors come as RuntimeError, told apart by their text. The exception's
    context chain counts too: clean-up in a `finally` (the engine's release after a rollout) may raise
    over the collective's error."""
    import torch.distributed as dist
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError) or (
                isinstance(e, RuntimeError) and any(m in str(e) for m in _COLLECTIVE_MARKERS)):
            return True
        e = e.__cause__ or e.__context__
    return False


@dataclass(frozen=True)
class PeerReport:
    """What the other ranks published after a failure."""
    raised: dict[int, str]           # rank -> its own error line
    silent: list[int]                # ranks that reported nothing within GRACE_S (lost)
    positions: dict[int, str]        # rank -> "node stage rollout_id" as last published
    store_ok: bool


def _has(store: Any, key: str) -> bool:
    return _try(store.check, [key]) is True


def _read(store: Any, key: str) -> str | None:
    if not _has(store, key):
        return None
    v = _try(store.get, key)
    return v.decode() if isinstance(v, bytes) else None


def gather_peers(pos: Position, world_size: int, grace_s: float = GRACE_S) -> PeerReport:
    """Publish that this rank survived, then wait (up to grace_s) for every other rank's word."""
    store = pos.store
    if store is None or _try(store.set, f"furlong/survived/{pos.rank}", "1") is _FAILED:
        return PeerReport({}, [], {}, store_ok=False)
    others = [r for r in range(world_size) if r != pos.rank]
    raised: dict[int, str] = {}
    deadline = time.monotonic() + grace_s
    while True:
        pending = []
        for r in others:
            if r in raised:
                continue
            line = _read(store, f"furlong/raised/{r}")
            if line is not None:
                raised[r] = line
            elif not _has(store, f"furlong/survived/{r}"):
                pending.append(r)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    positions = {r: p for r in others if (p := _read(store, f"furlong/pos/{r}")) is not None}
    return PeerReport(raised, pending, positions, store_ok=True)


def _where(rank: int, positions: dict[int, str]) -> tuple[int, str]:
    """(node, stage words) of a peer from its last published position."""
    parts = positions.get(rank, "").split(" ")
    if len(parts) < 3:
        return node_of(rank), "an unknown stage"
    rollout_id = None if parts[-1] == "None" else int(parts[-1])
    return int(parts[0]), describe_stage(" ".join(parts[1:-1]), rollout_id)


def publish_raised(pos: Position, line: str) -> None:
    if pos.store is not None:
        _try(pos.store.set, f"furlong/raised/{pos.rank}", line)


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def stop_report(e: BaseException, pos: Position, world_size: int, cfg: Any, command: str,
                own_line: str | None) -> str:
    """The one line for a failed run of several ranks (module docstring). `own_line` is this rank's
    line for an error the user caused (None: a collective failure or a bug). Called once, on the way out."""
    if threading.current_thread() is threading.main_thread():
        # torchrun's agent SIGTERMs the other local workers when one fails; finish this line first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if debug_enabled():
        traceback.print_exception(e)
    if own_line is not None:                 # this rank raised a user error: its line, as at one rank
        publish_raised(pos, own_line)
        return own_line
    me = f"rank {pos.rank} (node {pos.node})"
    if not is_collective_failure(e):         # a bug on this rank
        line = f"{me} failed during {pos.here()}: {_short(e)}"
        publish_raised(pos, line)
        return f"{line}{_hint(cfg, command)} ({DEBUG_ENV}=1 prints the traceback)"
    peers = gather_peers(pos, world_size)
    if peers.raised:
        r = min(peers.raised)
        node, where = _where(r, peers.positions)
        text = peers.raised[r].removeprefix("furlong: error: ")
        what = text if text.startswith(f"rank {r} ") else f"rank {r} (node {node}) failed during {where}: {text}"
    elif peers.silent:
        r = peers.silent[0]
        node, where = _where(r, peers.positions)
        also = f" (ranks {', '.join(map(str, peers.silent[1:]))} too)" if len(peers.silent) > 1 else ""
        what = f"rank {r} (node {node}) stopped during {where}{also}"
    else:
        why = "" if peers.store_ok else "; the rendezvous store is unreachable too"
        what = f"{me} lost a peer during {pos.here()} ({_short(e)}{why})"
    return f"{what}{_hint(cfg, command)}"


def record_for_torchrun(line: str) -> None:
    """torchrun's failure summary shows the worker's error file as the "traceback" of the root cause;
    give it the line (TORCHELASTIC_ERROR_FILE is set by torchrun for each worker)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        except OSError:
            pass   # the summary then says "To enable traceback see ..."; the line was printed anyway


def last_complete_checkpoint(save_dir: str | None) -> Path | None:
    """The newest intact iter_* of save_dir at or below its tracker's iteration (checkpoint/verify.py)."""
    from furlong.checkpoint.verify import damage, iteration_path, latest_iteration, saved_iterations
    if save_dir is None:
        return None
    try:
        top = latest_iteration(save_dir)
    except ValueError:
        return None
    for it in reversed([i for i in saved_iterations(save_dir) if top is not None and i <= top]):
        if damage(iteration_path(save_dir, it)) is None:
            return iteration_path(save_dir, it)
    return None


def _hint(cfg: Any, command: str) -> str:
    """'; last complete checkpoint: ...; resume: ...' for the line's end."""
    save = cfg.ckpt.save
    if save is None:
        return "; no checkpoint to resume from (no --save)"
    path = last_complete_checkpoint(save)
    where = f"last complete checkpoint: {path}" if path is not None else f"no complete checkpoint in {save} yet"
    restarts, done = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")), int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if done < restarts and cfg.ckpt.load is not None and Path(cfg.ckpt.load).resolve() == Path(save).resolve():
        then = "resume from it" if path is not None else "start over"
        return f"; {where}; torchrun restarts the workers (restart {done + 1} of {restarts}), which {then}"
    return f"; {where}; resume: {resume_command(cfg, command)}"


def resume_command(cfg: Any, command: str = "train") -> str:
    """The command that resumes this run from --save: its flags (those not at their defaults) with
    --load set to --save, under the torchrun launch this process came from (for this node)."""
    from furlong.config import Config
    cfg = dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load=cfg.ckpt.save, ckpt_step=None))
    argv = [command]
    defaults = Config()
    for group in dataclasses.fields(Config):
        mine, default = getattr(cfg, group.name), getattr(defaults, group.name)
        for f in dataclasses.fields(mine):
            v = getattr(mine, f.name)
            if v == getattr(default, f.name):
                continue
            flag_ = "--" + f.name.replace("_", "-")
            if isinstance(v, bool):
                argv.append(flag_)
            elif isinstance(v, list):
                argv += [flag_, *map(str, v)]
            elif v is not None:
                argv += [flag_, str(v)]
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        lws = int(env.get("LOCAL_WORLD_SIZE", "1"))
        launch = ["torchrun", "--nnodes", str(int(env.get("WORLD_SIZE", "1")) // lws), "--nproc-per-node", str(lws),
                  "--node-rank", env.get("GROUP_RANK", "0"), "--master-addr", env.get("MASTER_ADDR", "?"),
                  "--master-port", env.get("MASTER_PORT", "?"), "-m", "furlong"]
    else:
        launch = ["furlong"]
    return shlex.join(launch + argv)
