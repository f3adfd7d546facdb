"""`flag`: one config field of config.py's flag groups (its own module so that config.py and
config_debug_flags.py can both build groups with it without importing each other in a circle)."""
from __future__ import annotations

from dataclasses import field
from typing import Any

# --save-debug-rollout-data given bare (furlong's older form): the run directory's samples/ files. It has
# no {rollout_id}, which a given path template must have, so no value can be mistaken for it.
RUN_DIR_SAMPLES = "<output-dir>/samples"


def flag(default: Any = None, help: str = "", **meta: Any) -> Any:
    """A config field; `meta` may carry aliases=[...], sglang=True (accepted, reported, unused) or, for a
    str field, const=VALUE: the flag may also be given bare, meaning VALUE (argparse nargs='?')."""
    kwargs: dict[str, Any] = {"metadata": {"help": help, **meta}}
    if isinstance(default, (list, dict)):
        kwargs["default_factory"] = lambda d=default: type(d)(d)
    else:
        kwargs["default"] = default
    return field(**kwargs)
