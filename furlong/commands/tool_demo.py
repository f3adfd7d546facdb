"""`furlong demo --task calculator`: GRPO teaching a tiny model to call a calculator, from nothing.

1. The calculator task (tasks/calculator_task.py): the synthetic word problems with operands of up to
   `digits` digits, too large for a small model to add or multiply in its head, and a held-out split.
2. The demo tokenizer (tasks/tokenizer.py) with Qwen3's `<tool_call>` and `</tool_call>` as single
   tokens, and a random Qwen3-architecture model (demo.py).
3. SFT where `sft_tool_fraction` of the solutions call the calculator in Qwen3's format and box the
   tool's result, and the rest work the problem out in the head (correctly, in the data; the model
   that imitates them is mostly wrong). The fine-tuned model calls the tool on about that fraction
   of its samples at T=1 and, below one half, never greedily: like a base model that knows the tool
   but rarely reaches for it.
4. GRPO with the multi-turn calculator generate function (tools/calculator_generate.py: the tool's
   result enters the conversation as tool tokens, masked out of the loss) and the math reward on the
   final answer; nothing tells the model to call the tool but that answers with it are right. The
   rest is the synthetic demo's recipe (demo.py grpo_config: group-normalized advantages, dynamic-
   sampling filter, PPO clip 0.2/0.28, no KL), with its departures (a far higher learning rate).
5. Held-out accuracy and tool-call rate (the share of samples that called the tool) before GRPO and
   every `eval_interval` rollouts, greedy and at T=1 (`sampled_eval_samples` per prompt), as two
   eval sets of the GRPO run (--eval-config): calc (greedy) and calc_sampled.
It prints `tool demo: held-out accuracy A% -> B% greedy (tool calls X% -> Y%), ...`, writes the curves
to evals.json and draws the GRPO run (`furlong plot`: training reward and tool-call rate, the evals)
to grpo/metrics.png when matplotlib is installed.

Deviation from the calculator recipe as a user runs it on Qwen3: the demo's ChatML template does not
render `tools=` (the rows carry the spec, the tiny model never reads it): it learns its one tool
from SFT, and a system prompt of the spec would only cost tokens.

Presets (`--device`): "cpu" (10-13 minutes on 2 shared cores; seed 0: greedy 0.5% -> 93.5% with
tool calls 0% -> 100%, sampled 9.5% -> 56.0% with tool calls 24.2% -> 99.0%; BENCHMARKS.md, "CPU
tool-use demo"; most of the tool-call rate comes in the first 5 rollouts, the rest is copying
operands and results more accurately),
"gpu" (`--device cuda`: the synthetic demo's 14M-parameter model on 4-digit operands, a quarter of
the problems two-step, 100 rollouts of 64 prompts x 8 samples; not yet run), "quick" (plumbing, tests/test_tool_demo.py). `--set NAME=VALUE`
overrides one ToolDemoScale field.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from furlong.commands.demo_scale import RecipeScale
from furlong.config import Config

EVAL_SETS = ("calc", "calc_sampled")   # greedy, and at the rollout temperature


@dataclass
class ToolDemoScale(RecipeScale):
    """The shared recipe (demo_scale.RecipeScale) with the calculator task's fields and the defaults it
    changes."""
    num_train: int = 3000
    two_step_fraction: float = 0.0
    vocab_size: int = 512
    sft_epochs: int = 8               # copying 3-digit operands into a call takes the tiny model this long
    num_rollout: int = 30
    grpo_steps_per_rollout: int = 2
    eval_interval: int = 5            # rollouts between evals (0: before and after GRPO only)
    digits: int = 3                   # operands up to 10**digits - 1 (products of up to 2 * digits digits)
    sft_tool_fraction: float = 0.3    # SFT solutions that call the calculator (the rest: in the head)
    max_context_len: int = 256        # prompt + all turns + tool tokens


PRESETS = {
    "cpu": ToolDemoScale(),
    "quick": ToolDemoScale(num_train=300, num_test=16, hidden=64, num_layers=2, sft_epochs=1, num_rollout=2,
                           rollout_batch_size=4, n_samples=4, grpo_steps_per_rollout=1, max_response_len=24,
                           max_context_len=200, dynamic_filter=False, eval_interval=0, sampled_eval_samples=2),
    # Sized by analogy with demo.py's gpu preset (300 rollouts of 64 x 8 in 350 s on one H200): a third of
    # the rollouts, each about twice the tokens (two model turns and the tool's), the same model.
    # Four SFT epochs: on the CPU, copying operands into the call was what SFT took longest to teach.
    "gpu": ToolDemoScale(num_train=30000, num_test=500, digits=4, two_step_fraction=0.25, hidden=384,
                         num_layers=8, num_heads=6, sft_epochs=4, sft_lr=1e-3, sft_batch=128, num_rollout=100,
                         rollout_batch_size=64, grpo_lr=3e-5, grpo_lr_warmup=8, max_response_len=64,
                         max_context_len=320, eval_interval=10, sampled_eval_samples=4, device="cuda"),
}


def eval_config(data: Path, scale: ToolDemoScale) -> dict:
    """--eval-config: the held-out split twice, greedy (top-k 1) and at T=1."""
    path = str(data / "test.parquet")
    return {"eval": {"datasets": [
        {"name": EVAL_SETS[0], "path": path, "top_k": 1, "n_samples_per_eval_prompt": 1},
        {"name": EVAL_SETS[1], "path": path, "temperature": 1.0,
         "n_samples_per_eval_prompt": max(1, scale.sampled_eval_samples)}]}}


def tool_grpo_config(out: Path, data: Path, scale: ToolDemoScale, seed: int) -> Config:
    """demo.py's GRPO recipe with the calculator generate function and the two eval sets."""
    from furlong.commands.demo import grpo_config
    rl = grpo_config(out, data, scale, seed)
    rl.rollout.custom_generate_function_path = "furlong.tools.calculator_generate.generate"
    rl.rollout.rollout_max_context_len = scale.max_context_len
    rl.eval.eval_prompt_data, rl.eval.eval_top_k = [], None
    config_path = out / "eval_config.json"
    config_path.write_text(json.dumps(eval_config(data, scale)))
    rl.eval_set.eval_config = str(config_path)
    rl.ckpt.save = None          # both evals run inside the GRPO run: no checkpoints to score afterwards
    return rl


def eval_curves(metrics_path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{eval set: {"accuracy": [(rollouts trained, mean reward)], "tool_call_rate": [...]}} of a GRPO run."""
    from furlong.commands.demo import eval_series
    series = eval_series(metrics_path, *(k for name in EVAL_SETS for k in (f"eval/{name}",
                                                                            f"eval/{name}/tool_call_ratio")))
    return {name: {"accuracy": series[f"eval/{name}"], "tool_call_rate": series[f"eval/{name}/tool_call_ratio"]}
            for name in EVAL_SETS}


def summary_line(curves: dict, scale: ToolDemoScale, seconds: float) -> str:
    def pct(series):
        return f"{100 * series[0][1]:.1f}% -> {100 * series[-1][1]:.1f}%"
    g, s = curves[EVAL_SETS[0]], curves[EVAL_SETS[1]]
    return (f"tool demo: held-out accuracy {pct(g['accuracy'])} greedy (tool calls {pct(g['tool_call_rate'])}), "
            f"{pct(s['accuracy'])} sampled (T=1, {scale.sampled_eval_samples} per prompt; tool calls "
            f"{pct(s['tool_call_rate'])}) ({seconds:.0f}s)")


def run_tool_demo(output_dir: str | None = None, seed: int = 0, quick: bool = False, device: str = "cpu",
                  settings: list[str] | None = None, scale: ToolDemoScale | None = None) -> int:
    """The tool demo at `scale`, else the preset for `device` ("quick" with quick=True), with --set overrides."""
    from furlong.commands.demo import plot_grpo_run, sft_config, write_random_qwen3
    from furlong.commands.demo_scale import apply_overrides
    from furlong.commands.sft import run_sft
    from furlong.launch.distributed import destroy_distributed, init_distributed
    from furlong.run.loop import run_rl
    from furlong.tasks.calculator_task import TOOL_TAGS, calculator_problems, corpus, prepare_calculator_task
    from furlong.tasks.tokenizer import build_tokenizer

    if scale is None:
        preset = "quick" if quick else {"cpu": "cpu", "cuda": "gpu"}.get(device)
        if preset is None:
            raise ValueError(f"--device: {device!r} is not cpu or cuda")
        scale = PRESETS[preset]
    scale = apply_overrides(scale, settings or [])
    if not 0 < scale.sampled_eval_samples:
        raise ValueError(f"--set sampled_eval_samples: must be >= 1, got {scale.sampled_eval_samples}")
    out = Path(output_dir or f"runs/tool-demo-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    print(f"tool demo: writing to {out}", flush=True)
    data = out / "data"
    prepare_calculator_task(data, scale.num_train, scale.num_test, seed, digits=scale.digits,
                            two_step_fraction=scale.two_step_fraction, sft_tool_fraction=scale.sft_tool_fraction)
    train, _ = calculator_problems(scale.num_train, scale.num_test, seed, scale.digits, scale.two_step_fraction)
    tok_dir = build_tokenizer(corpus(train), out / "tokenizer", vocab_size=scale.vocab_size, added_tokens=TOOL_TAGS)
    base = write_random_qwen3(out / "base", tok_dir, scale, seed)
    print(f"tool demo: data, tokenizer and a random {scale.num_layers}-layer Qwen3 model ready "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    ctx = init_distributed(scale.device)
    try:
        print(f"tool demo: supervised fine-tuning ({100 * scale.sft_tool_fraction:.0f}% of the solutions call "
              "the calculator)", flush=True)
        run_sft(sft_config(base, data / "sft.parquet", out, scale, seed), ctx)
        print("tool demo: GRPO with the calculator", flush=True)
        run_rl(tool_grpo_config(out, data, scale, seed), ctx)
    finally:
        destroy_distributed()

    curves = eval_curves(out / "grpo" / "metrics.jsonl")
    plot_grpo_run(out / "grpo")
    (out / "evals.json").write_text(json.dumps({**curves, "sampled_samples_per_prompt": scale.sampled_eval_samples}))
    print(summary_line(curves, scale, time.perf_counter() - t0), flush=True)
    return 0
