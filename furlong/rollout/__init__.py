"""furlong.rollout: the built-in generation engine, the over-sampling rollout, filters and eval."""
from furlong.rollout.eval import EvalResult, run_eval
from furlong.rollout.filters import GroupFilter, check_reward_nonzero_std, load_filter
from furlong.rollout.generator import Generation, Generator
from furlong.rollout.kv_cache import StaticKVCache
from furlong.rollout.rollout import (RankInfo, RolloutBatch, RolloutError, RolloutMetrics, RolloutSpec,
                                     generate_rollout)
from furlong.rollout.sampling import SamplingParams, sample_next

__all__ = ["EvalResult", "run_eval", "GroupFilter", "check_reward_nonzero_std", "load_filter", "Generation",
           "Generator", "StaticKVCache", "RankInfo", "RolloutBatch", "RolloutError", "RolloutMetrics",
           "RolloutSpec", "generate_rollout", "SamplingParams", "sample_next"]
