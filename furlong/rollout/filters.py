"""Dynamic-sampling group filters (`--dynamic-sampling-filter-path`, docs/design.md §6).

A filter takes a finished Group (rewards set) and returns True to keep it.
Built-in: `check_reward_nonzero_std` keeps a group whose rewards are not all
equal (population std > 1e-8) — a group with equal rewards has zero GRPO
advantage everywhere and teaches nothing.

Paths are resolved in one place, `_BUILTIN`: furlong's own path and the miles
and slime paths of the same function map to the built-in. Any other dotted
path `pkg.module.fn` is imported as a user function Group -> bool.
Deviation from miles: miles' filters take `(args, samples)` and return a
DynamicFilterOutput; furlong's take the Group and return a bool.
"""
from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

from furlong.types import Group

FilterFn = Callable[[Group], bool]
FLAG = "--dynamic-sampling-filter-path"


def check_reward_nonzero_std(group: Group) -> bool:
    """Keep the group iff its rewards' population std exceeds 1e-8."""
    rewards = group.rewards
    if not rewards:
        return False
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return std > 1e-8


class FilterError(RuntimeError):
    """A user filter failed on a group (raised, exited, or returned no truth value): the run stops."""


@dataclass
class GroupFilter:
    name: str          # drop reason in metrics: rollout/dynamic_filter/drop_<name>
    fn: FilterFn

    def __call__(self, group: Group) -> bool:
        try:
            return bool(self.fn(group))
        except (Exception, SystemExit) as e:   # user code: one line naming the filter and the group
            what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
            raise FilterError(f"{FLAG}: filter {self.name} {what} on group {group.group_id} (prompt row "
                              f"{group.samples[0].prompt.row if group.samples else '?'})".splitlines()[0]) from None


_BUILTIN: dict[str, GroupFilter] = {
    path: GroupFilter("zero_std", check_reward_nonzero_std)
    for path in (
        "furlong.rollout.filters.check_reward_nonzero_std",
        "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    )
}


def load_filter(path: str | None) -> GroupFilter | None:
    """The filter named by the flag value; None when no filter is set."""
    if path is None or path == "":
        return None
    if path in _BUILTIN:
        return _BUILTIN[path]
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{FLAG}: expected a dotted path module.function, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure is a bad flag value
        raise ValueError(f"{FLAG}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{FLAG}: {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind(object())
    except TypeError:
        raise ValueError(f"{FLAG}: {path} must take one positional argument, the Group (miles-style "
                         "fn(args, samples) is not supported)") from None
    except ValueError:
        pass   # no introspectable signature (some builtins): trust the user
    return GroupFilter(attr, fn)
