"""User code named by a flag (`pkg.module.function`): one importer for rewards, filters, generate
and rollout functions, every failure a ValueError naming the flag (the CLI prints it as one line)."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable


def load_function(path: str, flag_name: str) -> Callable[..., Any]:
    """Import `pkg.module.function`; a missing module, attribute or non-callable names the flag."""
    module_name, _, fn_name = path.rpartition(".")
    if not module_name or not fn_name:
        raise ValueError(f"{flag_name}: expected 'module.function' (a dotted path), got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a bad flag value
        raise ValueError(f"{flag_name}: cannot import module {module_name!r} ({type(e).__name__}: {e}; "
                         "is its directory on PYTHONPATH?)".splitlines()[0]) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{flag_name}: module {module_name!r} has no function {fn_name!r}")
    return fn


def check_one_argument(fn: Callable[..., Any], path: str, flag_name: str, what: str, miles_form: str) -> None:
    """ValueError unless fn takes one positional argument (`what`); miles' two-argument form is named."""
    try:
        inspect.signature(fn).bind(object())
    except TypeError:
        raise ValueError(f"{flag_name}: {path} must take one positional argument, {what} (miles-style "
                         f"{miles_form} is not supported)") from None
    except ValueError:
        pass   # no introspectable signature (some builtins): trust the user
