"""Process set-up for `furlong train/sft/eval`: one process, N local workers, or torchrun.

`--actor-num-gpus-per-node N` (N > 1, not under torchrun) starts N worker
processes itself; under torchrun (RANK/WORLD_SIZE set) each process is a worker.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from furlong.config import Config


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _worker(kind: str, cfg: Config) -> int:
    from furlong.train.distributed import destroy_distributed, init_distributed
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


def _launch(kind: str, cfg: Config) -> int:
    n = cfg.parallel.actor_num_gpus_per_node
    if cfg.parallel.actor_num_nodes > 1 and not _under_torchrun():
        raise ValueError("--actor-num-nodes: runs over several nodes are launched with "
                         "`torchrun --nnodes ... -m furlong train ...`")
    if n > 1 and not _under_torchrun():
        from furlong.train.distributed import WorkerError, launch_local
        try:
            launch_local(_worker, n, kind, cfg)
        except WorkerError as e:
            # the failing worker printed its traceback; this is the one line that matters
            print(f"furlong {kind}: error: {e}", file=sys.stderr)
            return 1
        return 0
    return _worker(kind, cfg)


def train(cfg: Config) -> int:
    return _launch("train", cfg)


def sft(cfg: Config) -> int:
    return _launch("sft", cfg)


def evaluate(cfg: Config) -> int:
    return _launch("eval", cfg)


COMMANDS: dict[str, Callable[[Config], int]] = {"train": train, "sft": sft, "eval": evaluate}
