"""`flag`: one config field of config.py's flag groups (its own module so that config.py and
config_debug_flags.py can both build groups with it without importing each other in a circle)."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def flag(default: Any = None, help: str = "", **meta: Any) -> Any:
    """A config field; `meta` may carry aliases=[...] or sglang=True (accepted, reported, unused)."""
    kwargs: dict[str, Any] = {"metadata": {"help": help, **meta}}
    if isinstance(default, (list, dict)):
        kwargs["default_factory"] = lambda d=default: type(d)(d)
    else:
        kwargs["default"] = default
    return field(**kwargs)
