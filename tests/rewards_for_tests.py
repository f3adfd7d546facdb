"""Reward functions for the CLI tests (`--custom-rm-path tests.rewards_for_tests.<fn>`).

A tiny random model never answers a math problem correctly, so `--rm-type math`
would give every sample reward 0 and the dynamic-sampling filter would drop
every group. `hash_reward` is a deterministic function of the response text
that differs between the responses of a group, so groups pass the filter.
"""
from __future__ import annotations

import zlib

from furlong.types import Sample


def hash_reward(sample: Sample) -> float:
    """0 or 1 from a CRC of the response text: deterministic, varies within a group."""
    return float(zlib.crc32(sample.response_text.encode("utf-8")) % 2)


def index_reward(sample: Sample) -> float:
    """1 for even sample indices in a group, else 0: every group of >= 2 samples has reward std > 0.

    Eval samples are index 0 of their prompt (one sample per prompt), so eval/<name> is 1.0:
    the §1 block's `--ci-test ... --ci-metric-checker-threshold 0.71` then passes deterministically.
    """
    return 1.0 if sample.index % 2 == 0 else 0.0


def length_reward(sample: Sample) -> float:
    """Response length in tokens, scaled: deterministic and rarely equal within a group."""
    return len(sample.response_ids) / 10.0


def zero_reward(sample: Sample) -> float:
    """Always 0: every group has zero reward std, so the dynamic filter drops all of them."""
    return 0.0


def nan_reward(sample: Sample) -> float:
    """NaN: a broken reward the run must refuse in one line."""
    return float("nan")


def raising_reward(sample: Sample) -> float:
    """Raises on the second sample of a group: the error line names the function and the sample."""
    if sample.index == 1:
        raise KeyError("no label field 'answer'")
    return 0.0


def slow_reward(sample: Sample) -> float:
    """Sleeps 30 s: a hung reward that --reward-timeout must cut short."""
    import time
    time.sleep(30)
    return 0.0


def letter_reward(sample: Sample) -> float:
    """Share of the response's characters that are 'e': a target a policy can learn in a few steps."""
    text = sample.response_text.replace("<|im_end|>", "")
    return text.count("e") / max(len(text), 1)
