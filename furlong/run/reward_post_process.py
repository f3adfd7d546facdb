"""--custom-reward-post-process-path: the user's function from a rollout's rewards to the ones the advantages use.

miles calls `f(args, samples) -> (raw_rewards, rewards)` on a rollout's samples in place of its default
post-processing, which for grpo, gspo and reinforce_plus_plus_baseline is the group normalization; so
here too `rewards` go to the estimator with that normalization off (config_map.advantage_config), and
the other estimators read them as they would the raw rewards. furlong passes its own Sample objects
(types.Sample: .reward, .response_text, .index, .prompt.label, ...), flat, group after group, and
user_code.miles_args as `args`. `raw_rewards` are checked like `rewards` (one float per sample) but
not logged: rollout/raw_reward stays the reward functions' mean. DAPO's overlong shaping
(--overlong-buffer-len) applies on top, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from furlong.types import Sample
from furlong.user_code import UserCodeError, call_user

FLAG = "--custom-reward-post-process-path"


def _finite_number(v: Any) -> bool:
    try:
        return not isinstance(v, bool) and math.isfinite(float(v))   # ints, floats, 0-d tensors
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class RewardPostProcess:
    fn: Callable[..., Any]
    name: str            # how errors name it (the flag's module path)
    args: Any            # user_code.miles_args of the run

    def __call__(self, samples: list[Sample]) -> list[float]:
        """The rewards [N] the advantages use, one per sample, checked."""
        out = call_user(self.fn, self.name, FLAG, self.args, samples)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise UserCodeError(f"{FLAG}: {self.name} must return (raw_rewards, rewards), got {type(out).__name__}")
        for what, values in zip(("raw_rewards", "rewards"), out):
            if not isinstance(values, (list, tuple)) or len(values) != len(samples):
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise UserCodeError(f"{FLAG}: {self.name} returned {what} of {got}, expected a list of "
                                    f"{len(samples)} numbers (one per sample)")
            bad = next((v for v in values if not _finite_number(v)), None)
            if bad is not None:
                raise UserCodeError(f"{FLAG}: {self.name} returned {what} holding {bad!r}, expected finite numbers")
        return [float(v) for v in out[1]]
