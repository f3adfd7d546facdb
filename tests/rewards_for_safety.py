"""User code that misbehaves, for tests/test_safety_signals_errors.py (--custom-rm-path and
--dynamic-sampling-filter-path tests.rewards_for_safety.<fn>)."""
from __future__ import annotations

import os
import signal
import sys


def exit_reward(sample) -> float:
    sys.exit(3)


def huge_reward(sample) -> int:
    return 10**400


def none_reward(sample):
    return None


def sigterm_reward(sample) -> float:
    """Asks the process to stop while an eval is running (outside any training step)."""
    os.kill(os.getpid(), signal.SIGTERM)
    return 0.0


def boom_filter(group) -> bool:
    raise KeyError("no such field")


def miles_filter(args, samples) -> bool:
    return True
