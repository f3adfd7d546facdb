"""Reward functions by name, custom rewards by import path, and batch evaluation.

Built-in rewards score text: `fn(response, label) -> float`, picked by `--rm-type`
from SCORERS: `math` (furlong's checker, 1/0; math_reward), `deepscaler`
(boxed answer after `</think>`, 1/0; deepscaler) and `dapo` (DAPO's `Answer:`
line, 1/-1; dapo), the last two with the answer rules of miles, and miles' `f1`; a `boxed_`
prefix scores the last \\boxed{} content instead (miles_rules.py). `random` and
`deterministic_random` score samples, not text (miles_rules.py; `random` is seeded by --seed).
`--custom-rm-path pkg.module.function` names a plain or `async def` function
taking ONE positional argument, the `furlong.types.Sample` (use
`sample.response_text`, `sample.prompt.label`, `sample.prompt.raw`, ...), and
returning a number; it wins over `--rm-type`, as in miles. Deviation from miles:
miles calls custom rewards as `fn(args, sample)`; furlong has no miles `args`
object, so a function that requires two positional arguments is refused at load
time with a clear message instead of failing mid-rollout.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import inspect
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping

from furlong.rewards.dapo import dapo_score
from furlong.rewards.deepscaler import deepscaler_score
from furlong.rewards.math_reward import math_score
from furlong.rewards.miles_rules import SeededCoin, boxed, deterministic_random_reward, f1_score
from furlong.types import Sample
from furlong.user_code import check_one_argument, load_function

# Read-only: the set of --rm-type names is fixed at import time.
SCORERS: Mapping[str, Callable[[str, str], float]] = MappingProxyType({
    "math": math_score,
    "deepscaler": deepscaler_score,
    "dapo": dapo_score,
    "f1": f1_score,
})
SAMPLE_REWARDS = ("random", "deterministic_random")   # score the sample, not its text (miles_rules.py)

RewardFn = Callable[[Sample], "float | Awaitable[float]"]


def get_scorer(rm_type: str) -> Callable[[str, str], float]:
    """The built-in text scorer called `rm_type` (a `boxed_` prefix: on the last \\boxed{} content);
    ValueError naming --rm-type if unknown."""
    if isinstance(rm_type, str) and rm_type.startswith("boxed_") and rm_type[len("boxed_"):] in SCORERS:
        return boxed(SCORERS[rm_type[len("boxed_"):]])
    try:
        return SCORERS[rm_type]
    except (KeyError, TypeError):
        extra = f"; {rm_type} scores samples, not text" if rm_type in SAMPLE_REWARDS else ""
        raise ValueError(f"--rm-type: unknown reward {rm_type!r} ({', '.join(sorted(SCORERS))}, boxed_<one of "
                         f"them>, {', '.join(SAMPLE_REWARDS)}){extra}") from None


def score(rm_type: str, response: str, label: str) -> float:
    """Score one response against its label with the built-in reward `rm_type`."""
    return float(get_scorer(rm_type)(response, label))


def _builtin(rm_type: str) -> Callable[[Sample], float]:
    scorer = get_scorer(rm_type)

    def reward(sample: Sample) -> float:
        return float(scorer(sample.response_text, sample.prompt.label))

    reward.__name__ = f"{rm_type}_reward"
    return reward


def load_custom(path: str) -> RewardFn:
    """Import `pkg.module.function` (user_code.py); errors name --custom-rm-path."""
    fn = load_function(path, "--custom-rm-path")
    check_one_argument(fn, path, "--custom-rm-path", "the Sample", "fn(args, sample)")
    return fn


def get_reward_fn(rm_type: str | None, custom_rm_path: str | None, seed: int = 0, rank: int = 0) -> RewardFn:
    """The per-sample reward: the custom function if given, else the built-in `rm_type`; `seed` (--seed)
    and `rank` seed --rm-type random."""
    if custom_rm_path:
        return load_custom(custom_rm_path)
    if rm_type is None:
        raise ValueError("--rm-type: no reward chosen; pass --rm-type "
                         f"({', '.join(sorted(SCORERS))}) or --custom-rm-path module.function")
    if rm_type == "random":
        return SeededCoin(seed, rank)
    if rm_type == "deterministic_random":
        return deterministic_random_reward
    return _builtin(rm_type)


class RewardError(RuntimeError):
    """A reward function failed on a sample (raised, or returned a non-finite value): the run stops."""


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _as_float(value: Any, sample: Sample, fn: Any) -> float:
    """The reward as a finite float, else RewardError naming the function and the sample."""
    where = f"reward function {_fn_name(fn)} returned {{}} for sample (group {sample.group_id}, index {sample.index})"
    if not hasattr(value, "__float__"):   # None, str, list ...: float() would raise or mislead
        raise RewardError(where.format(f"{type(value).__name__} {str(value)[:40]!r}") + ", not a number")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError) as e:   # 10**400 overflows a float
        raise RewardError(where.format(f"{str(value)[:40]}") + f": not a float ({type(e).__name__})") from None
    if not math.isfinite(out):
        raise RewardError(where.format(out) + f"; the reward is {out}: rewards must be finite numbers")
    return out


class TimedReward:
    """A reward function whose every call must finish within `seconds`, else RewardError.

    Each sync call runs on a daemon thread (a call that hangs cannot be killed, but the run stops
    with one line instead of waiting forever, and the hung thread does not hold the exit);
    coroutines are awaited under asyncio.wait_for.
    """

    def __init__(self, fn: RewardFn, seconds: float):
        self.fn, self.seconds = fn, seconds
        self.__qualname__ = _fn_name(fn)

    def _timeout(self, sample: Sample) -> RewardError:
        return RewardError(f"reward function {self.__qualname__} took more than --reward-timeout "
                           f"{self.seconds:g}s on sample (group {sample.group_id}, index {sample.index})")

    def __call__(self, sample: Sample) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = self.fn(sample)
            except BaseException as e:   # re-raised in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=run, daemon=True, name="reward")
        worker.start()
        worker.join(self.seconds)
        if worker.is_alive():
            raise self._timeout(sample)
        if "error" in box:
            raise box["error"]
        value = box["value"]
        return self._bounded(value, sample) if inspect.isawaitable(value) else value

    async def _bounded(self, awaitable: Awaitable[Any], sample: Sample) -> Any:
        try:
            return await asyncio.wait_for(awaitable, self.seconds)
        except asyncio.TimeoutError:
            raise self._timeout(sample) from None


def _call(fn: RewardFn, sample: Sample) -> Any:
    try:
        return fn(sample)
    except RewardError:
        raise
    except SystemExit as e:   # sys.exit() in a reward would end the run with no line
        raise RewardError(f"reward function {_fn_name(fn)} called sys.exit({e.code!r}) on sample (group "
                          f"{sample.group_id}, index {sample.index})") from None
    except Exception as e:   # a user's reward code: report which call failed, in one line
        raise RewardError(f"reward function {_fn_name(fn)} raised on sample (group {sample.group_id}, index "
                          f"{sample.index}): {type(e).__name__}: {e}".splitlines()[0]) from e


async def _gather(pending: list[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*pending, return_exceptions=True))


def compute_rewards(fn: RewardFn, samples: list[Sample]) -> list[float]:
    """Rewards of `samples` in order; coroutines from an async `fn` are awaited together."""
    results = [_call(fn, s) for s in samples]
    waiting = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if waiting:
        pending = [results[i] for i in waiting]
        try:
            asyncio.get_running_loop()
            in_loop = True
        except RuntimeError:
            in_loop = False
        try:
            if in_loop:  # asyncio.run refuses to nest; run the batch's loop on a helper thread
                with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                    done = pool.submit(asyncio.run, _gather(pending)).result()
            else:
                done = asyncio.run(_gather(pending))
        except SystemExit as e:   # asyncio lets it through gather: which sample is not known
            raise RewardError(f"reward function {_fn_name(fn)} called sys.exit({e.code!r}) while rewarding "
                              f"{len(pending)} samples") from None
        for i, value in zip(waiting, done):
            if isinstance(value, RewardError):
                raise value
            if isinstance(value, BaseException):
                s = samples[i]
                raise RewardError(f"reward function {_fn_name(fn)} raised on sample (group {s.group_id}, index "
                                  f"{s.index}): {type(value).__name__}: {value}".splitlines()[0]) from value
            results[i] = value
    return [_as_float(r, s, fn) for r, s in zip(results, samples)]
