"""User functions for the miles-flag CLI tests (tests/test_miles_*_flags.py): a group reward, a dict
reward and an eval function, named by module path on the command line."""
from __future__ import annotations

import zlib

from furlong.types import Sample


def group_index_reward(samples: list[Sample]) -> list[float]:
    """--group-rm: called once per group; 1 for the first half of the group, 0 for the rest."""
    n = len(samples)
    return [1.0 if i < n // 2 else 0.0 for i in range(n)]


def scores(sample: Sample) -> dict:
    """A dict reward: acc (the index rule), len (a length score), cat (why it 'failed')."""
    acc = 1.0 if sample.index % 2 == 0 else 0.0
    return {"acc": acc, "len": len(sample.response_ids) / 100.0,
            "cat": "ok" if acc else ("crc_even" if zlib.crc32(sample.response_text.encode()) % 2 == 0 else "crc_odd")}


def eval_two_sets(args, rollout_id, data_source, evaluation=False):
    """--eval-function-path: miles' shape, {name: {"samples", "rewards"}} and {name: samples}, built from
    the run's eval sets without the engine (their samples' rewards are left for the run to compute)."""
    from furlong.rollout.async_rollout import new_sample
    assert evaluation is True
    first = data_source[0]
    samples = [new_sample(p, i, 0) for i, p in enumerate(first.prompts)]
    for s in samples:
        s.response_text, s.finish_reason = "42", "stop"
    return {first.name: samples, "fixed": {"samples": list(samples), "rewards": [0.25] * len(samples)}}
