"""`furlong demo`: the whole pipeline at laptop scale, from nothing.

1. Synthetic arithmetic word problems (GSM8K format) with a held-out test split.
2. A byte-level BPE tokenizer trained on them, with a ChatML template.
3. A small random Qwen3-architecture model written as an HF checkpoint.
4. SFT on the worked solutions (a short run: the model learns part of the
   arithmetic). Half of the SFT solutions end in prose ("So the result is 8.")
   rather than \\boxed{8}, which the math reward does not read: like a base
   model whose habits differ from what the reward expects, the fine-tuned model
   answers in both styles, and GRPO has a format to learn as well as arithmetic.
5. GRPO with the reference workload's recipe (math reward, group-normalized advantages,
   n samples per prompt, dynamic-sampling filter, PPO clip 0.2/0.28, no KL, dynamic batching),
   scaled down. Where it departs from that recipe: the learning rate is far higher (1e-4 for a
   1M-parameter model against 1e-6 for Qwen3-0.6B), and each rollout's samples are split into
   `grpo_steps_per_rollout` optimizer steps instead of one.
6. Held-out accuracy of the SFT model and every `eval_interval` rollouts, two ways: greedy
   (the eval inside the GRPO run) and sampled at the rollout temperature (`sampled_evals`, on
   the checkpoints saved at the same rollouts). Greedy is what a user of the model sees; sampled
   is what GRPO's reward optimizes, and it moves more smoothly.
It prints `demo: held-out accuracy A% -> B% greedy, C% -> D% sampled (...)`, writes both curves to
evals.json and draws the GRPO run (`furlong plot`) to grpo/metrics.png when matplotlib is installed.

Presets (`--device`):
- "cpu": the above; about 6 minutes on 2 cores (seed 0: greedy 20.0% -> 32.0%, sampled 7.2% ->
  19.8%; BENCHMARKS.md, "CPU demo"). Four optimizer steps per rollout: the sampled accuracy rose
  at every eval but the last; the greedy one made most of its gain in the first 4 rollouts.
- "gpu" (`--device cuda`): a 14M-parameter model, numbers up to 50, 70% two-step problems, 300
  GRPO rollouts of 64 prompts x 8 samples. Every SFT solution is boxed and worked, but for 65% of
  the two-step problems the SFT teacher stops after the first step and boxes that intermediate
  result (tasks/synthetic.py, early_stop_solution), as distilled solutions that quit before the
  work is done. The format is already right; what the SFT data teaches wrongly is to stop (above
  one half, stopping is the likelier continuation after the first step, so greedy decoding stops
  while some samples finish). Nothing but the reward tells GRPO to finish the work. Measured on one
  H200 (BENCHMARKS.md; seed 0, 350 s in all): greedy 29.4% -> 71.2%, sampled 29.8% -> 65.5%, mean
  response length 19.6 -> 26.3 tokens. Tried first on the H200: numbers up to 99, where the 14M
  model's arithmetic is the limit (+9 and +11 points in 200 rollouts at lr 1e-5 and 3e-5); half the
  SFT solutions without the worked steps (+3 points at best, 21.2% -> 24.4%).
- "quick": plumbing only, for tests/test_demo.py.
`--set NAME=VALUE` overrides one DemoScale field (demo_scale.py; repeatable): task difficulty, learning rates,
LoRA, the KV dtype.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from furlong.commands.demo_scale import PRESETS, DemoScale, RecipeScale, apply_overrides
from furlong.config import Config


def write_random_qwen3(out_dir: Path, tokenizer_dir: Path, scale: RecipeScale, seed: int) -> Path:
    """A random-init Qwen3ForCausalLM checkpoint (transformers' own init) with our tokenizer."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=scale.vocab_size, hidden_size=scale.hidden, intermediate_size=scale.hidden * 3,
        num_hidden_layers=scale.num_layers, num_attention_heads=scale.num_heads,
        num_key_value_heads=max(1, scale.num_heads // 2), head_dim=scale.hidden // scale.num_heads,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
        torch_dtype="float32", eos_token_id=None, bos_token_id=None)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = Qwen3ForCausalLM(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


def eval_series(metrics_path: Path, *keys: str) -> dict[str, list[tuple[int, float]]]:
    """{key: [(rollouts trained, value)]} of each metric in a run's metrics.jsonl, read once (an eval or a
    rollout's train/* line; the eval before training: 0)."""
    out: dict[str, list[tuple[int, float]]] = {key: [] for key in keys}
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        for key in keys:
            if key in rec:
                out[key].append((0 if rec.get("kind") == "eval" else rec["step"] + 1, rec[key]))
    return out


def sft_config(base: Path, sft_data: Path, out: Path, scale: RecipeScale, seed: int) -> Config:
    """SFT of `base` on `sft_data` (chat rows), cosine LR after a short warm-up, to out/sft_model."""
    sft = Config()
    sft.data.hf_checkpoint, sft.data.prompt_data = str(base), str(sft_data)
    sft.data.input_key, sft.data.label_key, sft.data.apply_chat_template = "messages", "label", True
    sft.optim.lr, sft.optim.weight_decay, sft.optim.clip_grad = scale.sft_lr, 0.0, 1.0
    sft_steps = (scale.num_train // scale.sft_batch) * scale.sft_epochs
    sft.optim.lr_decay_style, sft.optim.lr_warmup_iters = "cosine", max(1, min(10, sft_steps // 10))
    sft.optim.adam_beta2 = 0.98
    sft.batch.global_batch_size = scale.sft_batch
    sft.batch.use_dynamic_batch_size, sft.batch.max_tokens_per_gpu = True, "8192"
    sft.length.num_epoch = scale.sft_epochs
    sft.parallel.device, sft.parallel.seed = scale.device, seed
    sft.ckpt.save, sft.log.output_dir = str(out / "sft_model"), str(out / "sft")
    return sft


def grpo_config(out: Path, data: Path, scale: RecipeScale, seed: int) -> Config:
    """The reference workload's recipe (docs/design.md §1), scaled down to the demo model."""
    rl = Config()
    rl.data.hf_checkpoint, rl.data.prompt_data = str(out / "sft_model"), str(data / "train.parquet")
    rl.data.input_key, rl.data.label_key, rl.data.apply_chat_template = "messages", "label", True
    rl.data.rollout_shuffle, rl.data.rollout_seed = True, seed
    rl.reward.rm_type = "math"
    rl.rollout.num_rollout, rl.rollout.rollout_batch_size = scale.num_rollout, scale.rollout_batch_size
    rl.rollout.n_samples_per_prompt = scale.n_samples
    rl.rollout.rollout_max_response_len, rl.rollout.rollout_temperature = scale.max_response_len, 1.0
    rl.rollout.over_sampling_batch_size = scale.rollout_batch_size * 2
    if scale.dynamic_filter:
        rl.rollout.dynamic_sampling_filter_path = \
            "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    rl.eval.eval_prompt_data = ["synthetic", str(data / "test.parquet")]
    rl.eval.eval_interval = scale.eval_interval or scale.num_rollout
    rl.eval.eval_top_k = 1
    rl.optim.lr, rl.optim.weight_decay, rl.optim.lr_warmup_iters = scale.grpo_lr, 0.0, scale.grpo_lr_warmup
    rl.optim.adam_beta1, rl.optim.adam_beta2 = 0.9, 0.98
    rl.batch.global_batch_size = scale.rollout_batch_size * scale.n_samples // scale.grpo_steps_per_rollout
    rl.batch.use_dynamic_batch_size, rl.batch.max_tokens_per_gpu = True, "8192" if scale.device == "cpu" else "65536"
    rl.algo.eps_clip, rl.algo.eps_clip_high = 0.2, scale.eps_clip_high
    if scale.kl_loss_coef > 0:
        rl.algo.use_kl_loss, rl.algo.kl_loss_coef, rl.algo.kl_loss_type = True, scale.kl_loss_coef, "low_var_kl"
    if scale.sampled_eval_samples:   # a checkpoint at every greedy eval, for sampled_evals to score afterwards
        rl.ckpt.save, rl.ckpt.save_interval = str(out / "grpo_ckpt"), rl.eval.eval_interval
    rl.parallel.device, rl.parallel.seed = scale.device, seed
    rl.rollout.rollout_kv_fraction, rl.log.output_dir = scale.kv_fraction, str(out / "grpo")
    rl.rollout.rollout_kv_dtype = scale.rollout_kv_dtype
    rl.lora.lora_rank, rl.lora.lora_alpha = scale.lora_rank, scale.lora_alpha
    return rl


def sampled_evals(out: Path, data: Path, scale: DemoScale, seed: int, ctx) -> list[tuple[int, float]]:
    """Held-out accuracy at the rollout temperature (1.0), `sampled_eval_samples` samples per prompt
    (mean reward), of the SFT model and of each GRPO checkpoint: [(rollouts trained, accuracy)].

    The greedy eval inside the GRPO run and this one answer different questions: greedy is what
    the demo reports, sampled is what GRPO's reward optimizes. The run's eval flags have one
    setting for every eval set, so the sampled one scores the saved checkpoints afterwards.
    """
    from furlong.run.loop import run_eval_only
    from furlong.checkpoint.verify import saved_iterations

    ckpt_dir = out / "grpo_ckpt"
    scores = []
    for it in [0] + saved_iterations(ckpt_dir):   # 0: the SFT model
        cfg = Config()
        cfg.data.hf_checkpoint = str(out / "sft_model")
        cfg.data.input_key, cfg.data.label_key, cfg.data.apply_chat_template = "messages", "label", True
        cfg.data.rollout_seed = seed
        cfg.reward.rm_type = "math"
        cfg.rollout.rollout_max_response_len = scale.max_response_len
        cfg.rollout.rollout_temperature = 1.0
        cfg.rollout.rollout_kv_fraction, cfg.rollout.rollout_kv_dtype = scale.kv_fraction, scale.rollout_kv_dtype
        cfg.eval.eval_prompt_data = ["synthetic", str(data / "test.parquet")]
        cfg.eval.n_samples_per_eval_prompt = scale.sampled_eval_samples
        if it > 0:
            cfg.ckpt.load, cfg.ckpt.ckpt_step = str(ckpt_dir), it
        cfg.parallel.device, cfg.parallel.seed = scale.device, seed
        cfg.log.output_dir = str(out / "eval_sampled" / f"iter_{it}")
        run_eval_only(cfg, ctx)
        key = "eval/synthetic"
        scores.append((it, eval_series(Path(cfg.log.output_dir) / "metrics.jsonl", key)[key][-1][1]))
    return scores


def run_demo(output_dir: str | None = None, seed: int = 0, quick: bool = False,
             scale: DemoScale | None = None, device: str = "cpu", settings: list[str] | None = None) -> int:
    """The demo at `scale`, else the preset for `device` ("quick" with quick=True), with --set overrides."""
    from furlong.commands.sft import run_sft
    from furlong.run.loop import run_rl
    from furlong.tasks.synthetic import corpus, make_problems, plain_solution, prepare_synthetic
    from furlong.tasks.tokenizer import build_tokenizer
    from furlong.launch.distributed import destroy_distributed, init_distributed

    if scale is None:
        preset = "quick" if quick else {"cpu": "cpu", "cuda": "gpu"}.get(device)
        if preset is None:
            raise ValueError(f"--device: {device!r} is not cpu or cuda")
        scale = PRESETS[preset]
    scale = apply_overrides(scale, settings or [])
    out = Path(output_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    print(f"demo: writing to {out}", flush=True)
    data = out / "data"
    task = dict(max_number=scale.max_number, max_factor=scale.max_factor, two_step_fraction=scale.two_step_fraction)
    prepare_synthetic(data, scale.num_train, scale.num_test, seed, sft_unboxed_fraction=scale.sft_unboxed_fraction,
                      sft_direct_fraction=scale.sft_direct_fraction,
                      sft_early_stop_fraction=scale.sft_early_stop_fraction, **task)
    train, _ = make_problems(scale.num_train, scale.num_test, seed, **task)
    texts = corpus(train) + [plain_solution(p) for p in train]
    tok_dir = build_tokenizer(texts, out / "tokenizer", vocab_size=scale.vocab_size)
    base = write_random_qwen3(out / "base", tok_dir, scale, seed)
    print(f"demo: data, tokenizer and a random {scale.num_layers}-layer Qwen3 model ready "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    ctx = init_distributed(scale.device)
    try:
        print("demo: supervised fine-tuning on worked solutions", flush=True)
        run_sft(sft_config(base, data / "sft.parquet", out, scale, seed), ctx)

        rl = grpo_config(out, data, scale, seed)
        print("demo: GRPO on the synthetic task", flush=True)
        run_rl(rl, ctx)
        sampled = sampled_evals(out, data, scale, seed, ctx) if scale.sampled_eval_samples else []
    finally:
        destroy_distributed()

    # gap: [rollouts trained, mean |trainer - engine| log-prob of the trained tokens]: what fp8 KV or LoRA's
    # merged engine weights cost in mismatch, beside the accuracy they reach
    series = eval_series(out / "grpo" / "metrics.jsonl", "eval/synthetic", "train/rollout_logprob_abs_diff")
    greedy, gap = series["eval/synthetic"], series["train/rollout_logprob_abs_diff"]
    plot_grpo_run(out / "grpo")
    # both curves as [rollouts trained, held-out accuracy] pairs
    (out / "evals.json").write_text(json.dumps({"greedy": greedy, "sampled": sampled,
                                                "sampled_samples_per_prompt": scale.sampled_eval_samples,
                                                "rollout_logprob_abs_diff": gap}))
    line = f"demo: held-out accuracy {100 * greedy[0][1]:.1f}% -> {100 * greedy[-1][1]:.1f}% greedy"
    if sampled:
        line += (f", {100 * sampled[0][1]:.1f}% -> {100 * sampled[-1][1]:.1f}% sampled "
                 f"(T=1, {scale.sampled_eval_samples} per prompt)")
    print(f"{line} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return 0


def plot_grpo_run(run_dir: Path) -> None:
    """grpo/metrics.png, when matplotlib is there (an optional dependency)."""
    try:
        from furlong.commands.plot import plot_run
        path = plot_run(run_dir, run_dir / "metrics.png")
    except ImportError:
        return
    print(f"demo: plot {path}", flush=True)
