"""--group-rm: the custom reward is called once per group, `fn(samples) -> one reward per sample` (miles
calls it on the group's Sample list the same way). Each value goes through --reward-key like a
per-sample reward's; the call is bounded by --reward-timeout. Deviation from miles, which refuses
--group-rm in eval: eval groups (one prompt's samples) are rewarded the same way.

`reward_groups` (rollout/rollout.py) sees `per_group` and hands over whole groups.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from typing import Any, Callable

from furlong.rewards.keyed import KeyedReward
from furlong.rewards.registry import RewardError, TimedReward, _as_float, _call
from furlong.types import Sample


def _resolved(value: Any) -> Any:
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:   # asyncio.run refuses to nest
        return pool.submit(asyncio.run, wait()).result()


class GroupReward:
    per_group = True

    def __init__(self, fn: Callable[[list[Sample]], Any], key: str | None, seconds: float):
        self.fn, self.key, self.seconds = fn, key, seconds
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__name__

    def reward_group(self, samples: list[Sample]) -> list[float]:
        """Rewards of one group's samples, in order (RewardError naming the function otherwise)."""
        first = samples[0]
        timed = TimedReward(lambda _first: self.fn(list(samples)), self.seconds)
        timed.__qualname__ = self.__qualname__
        try:
            values = _resolved(_call(timed, first))
        except RewardError:
            raise
        except Exception as e:   # raised inside the awaited coroutine
            raise RewardError(f"reward function {self.__qualname__} raised on group {first.group_id}: "
                              f"{type(e).__name__}: {e}".splitlines()[0]) from e
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"--group-rm: reward function {self.__qualname__} returned {got} for group "
                              f"{first.group_id} of {len(samples)} samples; expected one reward per sample")
        pick = KeyedReward(self.fn, self.key).pick if self.key is not None else (lambda v, s: v)
        return [_as_float(pick(v, s), s, self.fn) for v, s in zip(values, samples)]
