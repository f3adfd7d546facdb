"""--seed -> the process-wide random generators (python `random`, numpy, torch CPU and CUDA).

Every rank seeds alike: the ranks must draw the same prompt order and initial values, and the
rollout's per-group sampling seeds are derived from the rollout seed (rollout.derive_seed), not
from these generators. numpy takes 32-bit seeds, so it gets the seed modulo 2**32.
"""
from __future__ import annotations

import random

import numpy as np
import torch

MAX_SEED = 2**63 - 1   # torch.manual_seed's range for a signed 64-bit seed


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)   # CPU and every CUDA device
