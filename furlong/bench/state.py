"""Shared state of one bench run: device, seeded random models, the Config, samples.

Weights are random (seeded, std 0.02 from the model's init) and token ids are
random: the bench measures speed only. The actor and the rollout engine start
from the same seeded weights; `build_hf_model` copies the engine's weights into
the matching transformers model (sdpa) for the HF baselines.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from furlong.bench.measure import free_memory
from furlong.bench.report import PartReport
from furlong.bench.workload import Workload
from furlong.config import Config
from furlong.models.decoder import Transformer
from furlong.trainer.fsdp import compute_dtype
from furlong.models.hf_config import ModelArgs
from furlong.trainer.memory_plan import MemoryPlan
from furlong.trainer.trainer_config import BatchingConfig
from furlong.types import TrainSample


class NullTokenizer:
    """The engine decodes response text at the end; random ids have no text, so decode to ""."""
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


class Bench:
    """Shared state of one bench run: device, seeded models (built lazily), results."""

    def __init__(self, workload: Workload, seed: int = 0, kv_dtype: str = "auto", cpu_offload: bool = False,
                 lora_rank: int = 0, lora_alpha: float = 16.0, optimizer_offload: bool = False,
                 reshard_after_forward: bool = False, offload_weights: bool = False):
        from furlong.launch.distributed import init_distributed
        self.w, self.seed = workload, seed
        self.kv_dtype = kv_dtype          # the engine's KV cache: auto (the model's dtype) | bf16 | fp8_e4m3
        self.cpu_offload = cpu_offload    # --fsdp-cpu-offload for the actor
        self.optimizer_offload = optimizer_offload   # --optimizer-cpu-offload for the actor
        self.reshard_after_forward = reshard_after_forward   # --fsdp-reshard-after-forward for the actor
        # --offload-rollout-level weight: the engine's weights are not resident while the actor trains
        self.offload_weights = offload_weights
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha   # --lora-rank/--lora-alpha (0: full-parameter)
        self.plan: MemoryPlan | None = None   # the actor's memory plan (CUDA), as run set-up makes it
        self.owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.ctx = init_distributed("auto")
        self.device = self.ctx.device
        self.dtype = compute_dtype(self.device)
        self.args = ModelArgs.from_hf_config(workload.model, source="workload model")
        self._engine: Transformer | None = None
        self._actor: Any = None
        self.reports: dict[str, PartReport] = {}

    def random_model(self) -> Transformer:
        """fp32 Transformer with the run's seeded init, built directly on the device."""
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            return Transformer(self.args)

    def engine(self) -> Transformer:
        """The rollout engine's copy: same initial weights as the actor, in the compute dtype."""
        if self._engine is None:
            self._engine = self.random_model().to(self.dtype).eval()
        return self._engine

    def config(self, **batch_overrides: Any) -> Config:
        w, cfg = self.w, Config()
        cfg.rollout.rollout_batch_size = len(w.prompt_lens)
        cfg.rollout.n_samples_per_prompt = w.n_samples_per_prompt
        cfg.rollout.rollout_temperature, cfg.rollout.rollout_top_p = w.temperature, w.top_p
        cfg.rollout.rollout_top_k = w.top_k
        cfg.rollout.rollout_max_response_len = max(w.response_lens)
        # the rlstep part's engine: its weights given back while the actor trains, or kept
        cfg.rollout.offload_rollout_level = ["kv_cache", "weight"] if self.offload_weights else ["kv_cache"]
        cfg.algo.eps_clip, cfg.algo.eps_clip_high = w.eps_clip, w.eps_clip_high
        o = cfg.optim
        o.optimizer, o.lr, o.weight_decay, o.adam_beta1, o.adam_beta2 = (w.optimizer, w.lr, w.weight_decay,
                                                                          w.adam_beta1, w.adam_beta2)
        b = cfg.batch
        b.global_batch_size, b.use_dynamic_batch_size = w.global_batch_size, w.use_dynamic_batch_size
        b.max_tokens_per_gpu, b.update_weight_buffer_size = str(w.max_tokens_per_gpu), w.update_weight_buffer_size
        cfg.batch = dataclasses.replace(b, **batch_overrides)
        return cfg

    def trainer_placement(self, cfg: Config) -> Config:
        """cfg with the bench's trainer placement flags (offloads, resharding) set, as every actor it builds."""
        cfg.parallel.fsdp_cpu_offload = self.cpu_offload
        cfg.parallel.optimizer_cpu_offload = self.optimizer_offload
        cfg.parallel.fsdp_reshard_after_forward = self.reshard_after_forward
        return cfg

    def actor(self):
        if self._actor is None:
            from furlong.config_map import actor_config
            from furlong.trainer.actor import Actor
            cfg = self.trainer_placement(self.config())
            cfg.lora.lora_rank, cfg.lora.lora_alpha = self.lora_rank, self.lora_alpha
            if self.cpu_offload or self.optimizer_offload:   # as run set-up: one line, not the OOM killer's SIGKILL
                from furlong.run.host_memory import check_offload_host_memory
                check_offload_host_memory(cfg, self.args, self.ctx.world_size, False, self.dtype.itemsize)
            self._actor = Actor(self.random_model(), actor_config(cfg), self.ctx)
            if self.device.type == "cuda" and self.w.use_dynamic_batch_size:
                # run set-up's memory plan: the workload's budget, recompute on or the budget lowered when
                # it would not fit (a bigger model with the seed's flags), the engine's weights reserved
                # unless released
                from furlong.trainer.memory_probe import plan_trainer_memory
                reserved = self.engine_reserved_bytes()
                self.plan = plan_trainer_memory(self._actor, self.w.max_tokens_per_gpu, False,
                                                min_tokens=max(self.w.sample_lengths()), reserved_bytes=reserved)
                self._actor.model.gradient_checkpointing = self.plan.gradient_checkpointing
                print(f"[bench] memory plan: {self.plan.max_tokens_per_gpu} tokens, recompute "
                      f"{'on' if self.plan.gradient_checkpointing else 'off'}"
                      + (f" ({self.plan.note})" if self.plan.note else ""), flush=True)
        return self._actor

    def engine_reserved_bytes(self) -> int:
        """What the actor's memory plan leaves to the engine's weights (--offload-rollout-level weight: none,
        and the engine's copy is not built for it: on an 80 GB card 8B's would not fit beside the actor)."""
        from furlong.trainer.memory_plan import engine_reserved_bytes
        return 0 if self.offload_weights else engine_reserved_bytes(self.engine(), released=False)

    def steps(self) -> BatchingConfig:
        """The workload's micro-batch plan (what the loop passes the trainers), with the memory plan's
        budget once the actor exists on CUDA."""
        from furlong.config_map import batching_config
        steps = batching_config(self.config())
        if self.plan is not None:
            steps = dataclasses.replace(steps, max_tokens_per_gpu=self.plan.max_tokens_per_gpu)
        return steps

    def release_actor(self) -> None:
        """Drop the actor and everything that pins it: compiled code caches hold references to the
        modules they traced, so without the reset its ~100 GiB stayed allocated for the next part."""
        self._actor = None
        torch._dynamo.reset()
        free_memory(self.device)
        if self.device.type == "cuda":
            left = torch.cuda.memory_allocated(self.device) / 2**30
            print(f"[bench] after releasing the actor: {left:.1f} GiB still allocated", flush=True)

    def train_samples(self) -> list[TrainSample]:
        """Random prompt/response ids with the forced lengths; one GRPO-like advantage per sample."""
        w, n = self.w, self.w.n_samples_per_prompt
        g = torch.Generator().manual_seed(self.seed + 1)
        prompts = [torch.randint(0, self.args.vocab_size, (p,), generator=g) for p in w.prompt_lens]
        out = []
        for i, r in enumerate(w.response_lens):
            resp = torch.randint(0, self.args.vocab_size, (r,), generator=g)
            out.append(TrainSample(token_ids=torch.cat([prompts[i // n], resp]), num_prompt_tokens=len(prompts[i // n]),
                                   advantages=torch.full((r,), float(torch.randn((), generator=g))),
                                   rollout_log_probs=-torch.rand(r, generator=g) * 5))
        return out


def build_hf_model(engine: Transformer, model_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device):
    """transformers' model for this config (sdpa) holding a copy of `engine`'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from furlong.models.hf_io import hf_state_dict
    kw = {k: v for k, v in model_cfg.items() if k not in ("architectures", "torch_dtype", "dtype", "model_type")}
    hf_cfg = AutoConfig.for_model(model_cfg["model_type"], **kw)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(engine.state_dict()), strict=False)
    allowed = {"lm_head.weight"} if model_cfg.get("tie_word_embeddings") else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"bench: HF model does not match ours (missing {missing}, unexpected {unexpected})")
    hf.tie_weights()
    hf.generation_config.eos_token_id = None   # exactly max_new_tokens tokens per row
    hf.generation_config.pad_token_id = 0
    return hf
