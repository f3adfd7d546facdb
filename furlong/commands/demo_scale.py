"""`furlong demo`'s settings: RecipeScale (the pipeline's knobs both demos share, commands/demo.py) and
DemoScale (with the arithmetic task's), the presets that `--device` / `--quick` pick, and `--set NAME=VALUE`
overrides of one field (typed as the field)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RecipeScale:
    """The pipeline's knobs both demos share (the model, SFT, GRPO, evals, the device): what
    write_random_qwen3, sft_config and grpo_config in commands/demo.py read."""
    num_train: int = 4000
    num_test: int = 200
    two_step_fraction: float = 0.1
    vocab_size: int = 384
    hidden: int = 128
    num_layers: int = 4
    num_heads: int = 4
    sft_epochs: int = 3
    sft_lr: float = 3e-3
    sft_batch: int = 64
    num_rollout: int = 24
    rollout_batch_size: int = 32
    n_samples: int = 8
    grpo_lr: float = 1e-4
    grpo_lr_warmup: int = 0           # optimizer steps of linear LR warm-up from 0 (then constant)
    grpo_steps_per_rollout: int = 4   # optimizer steps per rollout (each on 1/steps of its samples)
    kl_loss_coef: float = 0.0         # > 0: low_var_kl loss against the SFT model, times this
    eps_clip_high: float = 0.28       # PPO clip range above 1 (below: 0.2)
    max_response_len: int = 40        # tokens per response (the tool demo: per model turn)
    dynamic_filter: bool = True
    eval_interval: int = 4            # rollouts between greedy evals (0: before and after GRPO only)
    sampled_eval_samples: int = 4     # samples per held-out prompt at the rollout temperature (0: no sampled eval)
    device: str = "cpu"
    kv_fraction: float = 0.3          # of free GPU memory, for the engine's KV cache (GPU only)
    lora_rank: int = 0                # > 0: GRPO trains LoRA adapters of this rank, all linear layers (--lora-rank)
    lora_alpha: float = 16.0          # --lora-alpha (adapters' output scaled by alpha / rank)
    rollout_kv_dtype: str = "auto"    # --rollout-kv-dtype: auto | bf16 | fp8_e4m3 (rollouts and evals)


@dataclass
class DemoScale(RecipeScale):
    """`furlong demo`'s arithmetic task (tasks/synthetic.py) on top of the shared recipe."""
    max_number: int = 10
    max_factor: int = 5
    sft_unboxed_fraction: float = 0.5
    sft_direct_fraction: float = 0.0  # SFT solutions that skip the worked steps (tasks/synthetic.py)
    sft_early_stop_fraction: float = 0.0  # multi-step SFT solutions that stop after step one (tasks/synthetic.py)


PRESETS = {
    "cpu": DemoScale(),
    # Plumbing only (tests): too little SFT to score, so no filter (it would find no mixed groups).
    "quick": DemoScale(num_train=600, num_test=40, hidden=64, num_layers=2, sft_epochs=1, num_rollout=2,
                       rollout_batch_size=8, n_samples=4, grpo_steps_per_rollout=1, dynamic_filter=False,
                       eval_interval=0, sampled_eval_samples=2),
    # Numbers up to 50, mostly two-step problems, every SFT solution boxed and worked, but the SFT
    # teacher stops after the first step in 65% of the two-step solutions (boxing the intermediate
    # result), so that stopping is the fine-tuned model's likelier continuation after the first step
    # while some of its samples finish the work. GRPO (lr 3e-5, two optimizer steps
    # per rollout, an 8-step warm-up) has only the reward to teach it to finish. Tried on the H200
    # (BENCHMARKS.md), 200 rollouts: this task +32.8 points (29.4% -> 62.2%); with numbers
    # up to 99 the arithmetic is the limit (13.4% -> 22.6% at lr 1e-5, -> 24.2% at 3e-5).
    "gpu": DemoScale(num_train=30000, num_test=500, max_number=50, max_factor=9, two_step_fraction=0.7,
                     sft_unboxed_fraction=0.0, sft_early_stop_fraction=0.65, vocab_size=512, hidden=384,
                     num_layers=8, num_heads=6, sft_epochs=2, sft_lr=1e-3, sft_batch=128, num_rollout=300,
                     rollout_batch_size=64, grpo_lr=3e-5, grpo_lr_warmup=8, grpo_steps_per_rollout=2,
                     max_response_len=64, eval_interval=25, device="cuda"),
}


def apply_overrides(scale, settings: list[str]):
    """`--set NAME=VALUE` strings -> a copy of `scale` (any scale dataclass) with those fields replaced
    (typed as the field)."""
    import dataclasses
    fields = {f.name: f for f in dataclasses.fields(scale)}
    changes = {}
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set: expected NAME=VALUE with NAME one of {', '.join(fields)}; got {item!r}")
        kind = type(getattr(scale, name))
        try:
            changes[name] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"--set {name}: {value!r} is not of type {kind.__name__}") from None
    return dataclasses.replace(scale, **changes)
