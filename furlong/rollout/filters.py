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

import math
from dataclasses import dataclass
from typing import Callable

from furlong.user_code import check_one_argument, load_function
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
    fn = load_function(path, FLAG)
    check_one_argument(fn, path, FLAG, "the Group", "fn(args, samples)")
    attr = path.rpartition(".")[2]
    return GroupFilter(attr, fn)
