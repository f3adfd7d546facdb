"""--reward-key: the reward function returns a dict of scores; the sample trains on one of them (miles).

The chosen value becomes `sample.reward`; the whole dict is kept in `sample.metadata["rewards"]` (written
with the sample dumps). A value that is not a dict holding the key is a one-line error naming the flag.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from furlong.types import Sample


class KeyedReward:
    def __init__(self, fn: Callable[[Sample], Any], key: str):
        self.fn, self.key = fn, key
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__name__

    def pick(self, value: Any, sample: Sample) -> Any:
        if not isinstance(value, dict) or self.key not in value:
            got = f"a dict without {self.key!r}" if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"--reward-key: reward function {self.__qualname__} returned {got} for sample "
                             f"(group {sample.group_id}, index {sample.index}); expected a dict with {self.key!r}")
        sample.metadata["rewards"] = dict(value)
        return value[self.key]

    async def _later(self, pending: Any, sample: Sample) -> Any:
        return self.pick(await pending, sample)

    def __call__(self, sample: Sample) -> Any:
        value = self.fn(sample)
        return self._later(value, sample) if inspect.isawaitable(value) else self.pick(value, sample)
