"""A run's reward functions, built once from the flags (preflight.py): the training reward, the eval
reward (--eval-reward-key, default --reward-key, as miles) and, for an --eval-config set with its own
`rm_type`, that set's. Each is: the custom function (the API's callable, else --custom-rm-path) or
the built-in --rm-type; per group under --group-rm (group_reward.py); the dict key picked
(--reward-key / --eval-reward-key, keyed.py); every call bounded by --reward-timeout.
"""
from __future__ import annotations

from typing import Any, Callable

from furlong.config import Config
from furlong.rewards.group_reward import GroupReward
from furlong.rewards.keyed import KeyedReward
from furlong.rewards.registry import TimedReward, get_reward_fn


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def make_reward(cfg: Config, user_reward: Callable[..., Any] | None, key: str | None,
                rm_type: str | None = None) -> Callable[..., Any]:
    """`rm_type`: an eval set's own built-in reward (a custom function still wins, as in miles)."""
    custom = user_reward is not None or cfg.reward.custom_rm_path is not None
    base = user_reward if user_reward is not None else get_reward_fn(
        rm_type or cfg.reward.rm_type, cfg.reward.custom_rm_path, cfg.parallel.seed, _rank())
    if cfg.reward_mode.group_rm and custom:
        return GroupReward(base, key, cfg.reward.reward_timeout)
    if key is not None:
        base = KeyedReward(base, key)
    return TimedReward(base, cfg.reward.reward_timeout)


def eval_reward_key(cfg: Config) -> str | None:
    return cfg.eval_set.eval_reward_key if cfg.eval_set.eval_reward_key is not None else cfg.reward.reward_key
