"""The rollout engine: requests in, completions out, with continuous batching.

    engine = Engine(model, tokenizer, eos_token_ids, EngineConfig(...))
    engine.add(Request(...)); while engine.has_work(): done = engine.step()
    engine.generate(requests)  # the same, all at once; completions in request order
    engine.release()           # free the KV cache for the colocated trainer
    engine.release_weights()   # and the weights (offload_weights), until restore_weights + a weight sync

Multi-turn: a request with `retain_kv` keeps its pages when it finishes; the
next turn, `continues` = its id with the whole conversation as the prompt,
prefills only what is not cached (retained.py); `free` ends a conversation.

Each `step` is one scheduler plan (scheduler.py) run by the model runner
(model_runner.py) and handed back to the scheduler (`postprocess`): a packed
prefill of newly admitted prompts (each prompt once; its n samples fork from it
and draw their first tokens from its logits), a decode window of
`decode_window` tokens per running sequence, or both in one step (`mix_prefill`:
the prefill is launched behind the window, one host sync for the two). Finished sequences leave the
running set at the end of the window they finish in; their extra tokens of that
window are dropped, so a window of w costs each sequence at most w - 1 wasted
slots. Where a sequence stops and why: stop.py.
The KV cache is sized on first use per session from --rollout-kv-fraction of
the free GPU memory (CPU: `cpu_kv_tokens`) and freed by `release`; an fp8 cache
(`kv_dtype`, kv_fp8.py) has pages of about half the bytes, so the same fraction
holds about twice the tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from furlong.engine.block_manager import BlockManager, pages_for
from furlong.engine.kv_fp8 import KV_DTYPES
from furlong.engine.model_runner import ModelRunner
from furlong.engine.scheduler import Scheduler
from furlong.engine.sequence import Completion, Request, Sequence
from furlong.engine.stats import EngineStats
from furlong.engine.stop import StopRules, cut_after_stop


@dataclass
class EngineConfig:
    kv_fraction: float = 0.8          # of the GPU memory free when a session starts
    page_size: int = 64               # tokens per KV page
    max_num_seqs: int = 512           # running sequences (largest decode batch)
    max_prefill_tokens: int = 16384   # tokens per packed prefill
    decode_window: int = 16           # decode steps per host sync
    max_model_len: int = 4096         # prompt + response tokens of any request
    use_cuda_graphs: bool = True
    cascade: bool = True              # a group's shared prompt KV read once per decode step (cascade.py)
    share_prompts: bool = True        # same-prompt requests admitted together prefill it once (scheduler.py)
    mix_prefill: bool = True          # waiting work prefilled behind the running rows' window (scheduler.py)
    cascade_min_prefix: int = 256     # tokens: shorter shared prompts are read by each row (measured no gain)
    compile: bool | None = None       # torch.compile the layer blocks (None: on CUDA)
    cpu_kv_tokens: int = 1 << 16      # KV slots on CPU, where free memory is not measured
    kv_dtype: str = "auto"            # KV cache: "auto"/"bf16" the model's dtype, "fp8_e4m3" (kv_fp8.py)
    offload_weights: bool = False     # weights releasable during training (weight_arena.py; --offload-rollout-level)

    def __post_init__(self) -> None:
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"--rollout-kv-fraction: must be in (0, 1], got {self.kv_fraction}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--rollout-kv-dtype: must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not 1 <= self.decode_window <= self.page_size:
            raise ValueError(f"engine: decode_window must be in [1, page_size={self.page_size}], "
                             f"got {self.decode_window}")


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, eos_token_ids: list[int], config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_rules = StopRules(tokenizer, frozenset(eos_token_ids))
        self.cfg = config
        on_gpu = next(model.parameters()).is_cuda
        self.runner = ModelRunner(model, config.page_size, config.max_num_seqs, config.use_cuda_graphs,
                                  compile=on_gpu if config.compile is None else config.compile,
                                  cascade=config.cascade, cascade_min_prefix=config.cascade_min_prefix,
                                  kv_dtype=config.kv_dtype, offload_weights=config.offload_weights)
        self.scheduler: Scheduler | None = None
        self.stats = EngineStats()
        self._next_id = 0

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def new_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ---- session -------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg, runner = self.cfg, self.runner
        if runner.weights_released:
            raise RuntimeError("Engine: its weights were released for training (--offload-rollout-level weight); "
                               "restore_weights and a weight sync must come first")
        if runner.on_gpu:
            torch.cuda.empty_cache()     # colocated: the trainer's cached blocks are the engine's to use now
            free, _ = torch.cuda.mem_get_info(runner.device)
            num_pages = int(cfg.kv_fraction * free) // runner.page_bytes()
        else:
            num_pages = cfg.cpu_kv_tokens // cfg.page_size
        max_pages = pages_for(cfg.max_model_len + cfg.decode_window, cfg.page_size)
        blocks = BlockManager(num_pages, cfg.page_size)
        runner.allocate(num_pages, max_pages)
        self.scheduler = Scheduler(blocks, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.decode_window,
                                   cfg.max_model_len, self.stop_rules, self.stats,
                                   min_admit=max(1, cfg.max_num_seqs // 16), share_prompts=cfg.share_prompts,
                                   mix_prefill=cfg.mix_prefill)

    def release(self) -> None:
        """Free the KV cache and graphs (nothing may be running)."""
        if self.scheduler is not None and self.scheduler.has_work():
            raise RuntimeError("Engine.release: requests are still running")
        self.scheduler = None
        self.runner.release()

    def release_weights(self) -> None:
        """Free the weights too (EngineConfig.offload_weights), after `release`: for the trainer's step,
        which ends with restore_weights and the weight sync (run/step.py)."""
        if self.scheduler is not None:
            raise RuntimeError("Engine.release_weights: release the session first")
        self.runner.release_weights()

    def restore_weights(self) -> None:
        """Memory for the weights again; their values are undefined until the weight sync writes them."""
        self.runner.restore_weights()

    def reset_stats(self) -> EngineStats:
        return self.stats.take()

    # ---- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id}: prompt is empty")
        if request.n < 1:
            raise ValueError(f"request {request.request_id}: n must be >= 1, got {request.n}")
        if self.scheduler is None:
            self._start()
        self.scheduler.add(request)

    def free(self, request_ids: set[int]) -> None:
        """End these conversations: the retained KV pages of their finished requests are freed."""
        if self.scheduler is not None:
            self.scheduler.retained.drop(request_ids)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def abort(self, request_ids: set[int]) -> list[Completion]:
        if self.scheduler is None:
            return []
        return [self._completion(s) for s in self.scheduler.abort(request_ids)]

    def step(self) -> list[Completion]:
        """One plan (a prefill or a decode window); returns the sequences that finished in it."""
        if self.scheduler is None:
            return []
        started = time.perf_counter()
        with torch.inference_mode():
            plan = self.scheduler.schedule()
            if plan is None:
                done = []
            else:
                out = self.runner.run(plan)
                done = [self._completion(s) for s in self.scheduler.postprocess(plan, out)]
        elapsed = time.perf_counter() - started
        self.stats.seconds += elapsed
        if plan is not None and plan.prefill and not plan.decode:
            self.stats.prefill_seconds += elapsed
        return done

    def generate(self, requests: list[Request]) -> list[list[Completion]]:
        """All requests to completion; out[i] = request i's n completions by sample index."""
        for r in requests:
            self.add(r)
        by_id: dict[int, list[Completion]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for c in self.step():
                by_id[c.request_id].append(c)
        return [sorted(by_id[r.request_id], key=lambda c: c.index) for r in requests]

    # ---- completions --------------------------------------------------------------------------
    def _completion(self, seq: Sequence) -> Completion:
        text = self.tokenizer.decode(seq.response_ids, skip_special_tokens=False)
        if seq.stopped_by_string:
            text = cut_after_stop(text, seq.params.stop)
        return Completion(request_id=seq.request.request_id, index=seq.index, token_ids=seq.response_ids,
                          log_probs=list(seq.log_probs), text=text, finish_reason=seq.finish_reason or "abort")
