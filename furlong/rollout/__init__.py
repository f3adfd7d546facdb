"""furlong.rollout: the streaming over-sampling rollout, its filters and eval, on furlong.engine."""
from furlong.rollout.eval import EvalConfig, EvalResult, run_eval
from furlong.rollout.filters import GroupFilter, check_reward_nonzero_std, load_filter
from furlong.rollout.rollout import RolloutBatch, RolloutError, RolloutConfig, generate_rollout
from furlong.rollout.rollout_metrics import RolloutMetrics

__all__ = ["EvalConfig", "EvalResult", "run_eval", "GroupFilter", "check_reward_nonzero_std", "load_filter",
           "RolloutBatch", "RolloutError", "RolloutMetrics", "RolloutConfig", "generate_rollout"]
