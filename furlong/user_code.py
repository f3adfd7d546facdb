"""User code named by a flag (`pkg.module.function`): one importer for rewards, filters, generate,
rollout, loss and reward post-process functions, every failure a ValueError naming the flag (the CLI
prints it as one line); `call_user` turns what a running user function raises into the same line, and
`miles_args` is the flat flag namespace functions written for miles read as `args`."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import SimpleNamespace
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


def miles_args(cfg: Any) -> SimpleNamespace:
    """What a user function gets as miles' `args`: every flag of the run's Config by its dest name
    (args.tis_clip, args.n_samples_per_prompt, ...), flat as miles' argparse Namespace is."""
    out = SimpleNamespace()
    for group in dataclasses.fields(cfg):
        values = getattr(cfg, group.name)
        for f in dataclasses.fields(values):
            setattr(out, f.name, getattr(values, f.name))
    return out


class UserCodeError(ValueError):
    """A user function raised or returned the wrong thing: one line naming it (a ValueError: exit 2)."""


def call_user(fn: Callable[..., Any], name: str, flag_name: str, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs); any exception it raises becomes one UserCodeError line naming the flag and function."""
    try:
        return fn(*args, **kwargs)
    except UserCodeError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever user code raises is reported as that code's failure
        raise UserCodeError(f"{flag_name}: {name} raised {type(e).__name__}: {e}".splitlines()[0][:400]) from e
