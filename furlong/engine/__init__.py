"""furlong.engine: the rollout engine (continuous batching over a paged KV cache, CUDA graphs).

sequence.py (requests, sequences, completions) -> scheduler.py (what runs next,
over block_manager.py's pages; stop.py's finishing rules, stats.py's counters) ->
model_runner.py (tensors, prefill, graphed decode windows; decode_inputs.py
buffers, kv_cache.py attention, kernels.py Triton, sampling.py) -> engine.py
(the loop: schedule, run, postprocess; completions).
"""
from furlong.engine.engine import Engine, EngineConfig
from furlong.engine.stats import EngineStats
from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Completion, Request

__all__ = ["Engine", "EngineConfig", "EngineStats", "SamplingParams", "Completion", "Request"]
