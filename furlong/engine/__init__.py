"""furlong.engine: the rollout engine (continuous batching over a paged KV cache, CUDA graphs).

sequence.py (requests, sequences, completions) -> scheduler.py (what runs next,
over block_manager.py's pages) -> model_runner.py (tensors, prefill, graphed
decode windows; kv_cache.py attention, kernels.py Triton, sampling.py) ->
engine.py (the loop, stops, completions).
"""
from furlong.engine.engine import Engine, EngineConfig, EngineStats
from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Completion, Request

__all__ = ["Engine", "EngineConfig", "EngineStats", "SamplingParams", "Completion", "Request"]
