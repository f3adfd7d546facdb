"""Where a run's wandb and TensorBoard outputs go, from the flags (miles' semantics).

wandb: project, group, name (the run directory's name, with a random suffix unless
--disable-wandb-random-suffix), entity (--wandb-team), mode (--wandb-mode: online | offline |
disabled), dir (--wandb-dir, created first), id (--wandb-run-id, resumed with resume="allow"), and a
login to --wandb-host (with --wandb-key) unless offline. Deviation from miles: miles names the run after
--wandb-group; furlong after its run directory.
TensorBoard: <output dir>/tensorboard, or with --tb-project-name miles' tensorboard_log/<name>/<experiment>
(the experiment: the run directory's name; $TENSORBOARD_DIR wins, as in miles).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from furlong.config import Config


def wandb_settings(cfg: Config, out: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(wandb.init kwargs, wandb.login kwargs or None)."""
    lg, t = cfg.log, cfg.tracking
    name = out.name if lg.disable_wandb_random_suffix else f"{out.name}-{os.urandom(3).hex()}"
    init: dict[str, Any] = {"project": lg.wandb_project, "group": lg.wandb_group, "name": name,
                            "config": cfg.to_dict()}
    if t.wandb_team is not None:
        init["entity"] = t.wandb_team
    if t.wandb_mode is not None:
        init["mode"] = t.wandb_mode
    if t.wandb_dir is not None:
        os.makedirs(t.wandb_dir, exist_ok=True)   # wandb fails later, less clearly, without it
        init["dir"] = t.wandb_dir
    if t.wandb_run_id is not None:
        init["id"], init["resume"] = t.wandb_run_id, "allow"
    login = None
    if t.wandb_host is not None and t.wandb_mode != "offline":
        login = {"key": lg.wandb_key, "host": t.wandb_host}
    return init, login


def tensorboard_dir(cfg: Config, out: Path) -> Path:
    if cfg.tracking.tb_project_name is None:
        return out / "tensorboard"
    return Path(os.environ.get("TENSORBOARD_DIR") or Path("tensorboard_log") / cfg.tracking.tb_project_name / out.name)
