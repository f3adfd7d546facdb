"""Multi-turn rollout vs single-turn rollout with the same generated tokens (issue 22's benchmark).

The seed workload's shape (bench/seed_workload.json: Qwen3-0.6B, 32 prompts x 8 samples, forced
response lengths R_i, random weights): every sample's R_i model tokens are split into 3 model turns
(R_i // 3, R_i // 3, the rest), with a 64-token tool output (random ids, loss-masked in a real run)
after each of the first two. All 256 conversations run as coroutines on the asyncio front
(engine/async_front.py), sharing one continuous batch, each turn continuing the previous turn's KV.
Against:
  single_engine  the same R_i tokens in one turn, as the default rollout runs them (32 requests of
                 n = 8: each prompt prefilled once; the target's baseline)
  single_front   the same, one coroutine per sample on the front (n = 1 requests: what a custom
                 generate function with one turn costs; a prompt's n requests share its prefill)
and two variants of the multi-turn run: multi_turn_unmixed, every prefill a step of its own (before
mixed steps, scheduler.py), and multi_turn_admit_any, mixed with work admitted however little waits
(min_admit 1). Each is run twice; the second run is timed (the first captures CUDA graphs). Target:
multi_turn / single_engine <= 1.2.

    python bench/multiturn.py [--workload bench/seed_workload.json] [--output multiturn.json]
    python bench/multiturn.py --tiny          # CPU: a tiny model and 4 x 2 samples (tests/test_bench_multiturn.py)
    python bench/multiturn.py --count-only    # CPU: the workload's shape on the tiny model: the counts that
                                              # explain the ratio (decode steps, rows, context, prefills)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from furlong.engine import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from furlong.engine.async_front import AsyncEngine  # noqa: E402

NUM_TURNS = 3

TINY_MODEL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False}


class NullTokenizer:
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def turn_lens(total: int) -> list[int]:
    third = total // NUM_TURNS
    return [third, third, total - 2 * third]


def run_multi(engine: Engine, prompts: list[list[int]], lens: list[int], n: int, tool_len: int, seed: int) -> float:
    front = AsyncEngine(engine)
    rng = random.Random(seed)
    tools = [[[rng.randrange(engine.runner.args.vocab_size) for _ in range(tool_len)] for _ in range(NUM_TURNS - 1)]
             for _ in lens]

    async def one(i: int) -> None:
        ids = list(prompts[i // n])
        async with front.conversation(seed + i) as conv:
            for t, k in enumerate(turn_lens(lens[i])):
                turn = await conv.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=k, ignore_eos=True))
                ids += turn.token_ids + (tools[i][t] if t < NUM_TURNS - 1 else [])

    async def main() -> None:
        await front.serve(asyncio.gather(*(one(i) for i in range(len(lens)))))

    _sync(engine.device)
    start = time.perf_counter()
    asyncio.run(main())
    _sync(engine.device)
    return time.perf_counter() - start


def run_single_engine(engine: Engine, prompts: list[list[int]], lens: list[int], n: int, seed: int) -> float:
    requests = [Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=max(lens[i * n:(i + 1) * n]),
                                             ignore_eos=True), n=n, seed=seed + i,
                        sample_max_new_tokens=lens[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]
    _sync(engine.device)
    start = time.perf_counter()
    engine.generate(requests)
    _sync(engine.device)
    return time.perf_counter() - start


def run_single_front(engine: Engine, prompts: list[list[int]], lens: list[int], n: int, seed: int) -> float:
    front = AsyncEngine(engine)

    async def main() -> None:
        work = asyncio.gather(*(front.generate(prompts[i // n], SamplingParams(
            temperature=1.0, max_new_tokens=k, ignore_eos=True), seed=seed + i) for i, k in enumerate(lens)))
        await front.serve(work)

    _sync(engine.device)
    start = time.perf_counter()
    asyncio.run(main())
    _sync(engine.device)
    return time.perf_counter() - start


def with_scheduler(engine: Engine, run, **attrs):
    """`run` with these Scheduler attributes set on every session the engine starts meanwhile."""
    original = engine._start

    def start() -> None:
        original()
        for name, value in attrs.items():
            setattr(engine.scheduler, name, value)
    engine._start = start
    try:
        return run()
    finally:
        del engine._start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=str(ROOT / "bench" / "seed_workload.json"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 4 prompts x 2 samples")
    p.add_argument("--count-only", action="store_true",
                   help="CPU: the workload's prompts and lengths on the tiny model, for the step, row, context and "
                        "prefill counts (device-independent; the seconds mean nothing)")
    p.add_argument("--tool-len", type=int, default=64, help="tokens of each tool output")
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)
    from furlong.models.decoder import Transformer
    from furlong.models.hf_config import ModelArgs
    if a.tiny:
        model_cfg, prompt_lens, n, lens, tool_len = TINY_MODEL, [9, 13, 7, 11], 2, [12, 30, 19, 24, 8, 15, 27, 21], 8
    else:
        from furlong.bench.workload import load_workload
        w = load_workload(a.workload)
        model_cfg, prompt_lens, n, lens, tool_len = w.model, w.prompt_lens, w.n_samples_per_prompt, w.response_lens, \
            a.tool_len
        if a.count_only:
            model_cfg = TINY_MODEL
    on_cpu = a.tiny or a.count_only
    device = torch.device("cuda" if torch.cuda.is_available() and not on_cpu else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = ModelArgs.from_hf_config(model_cfg, source="workload model")
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args).to(dtype).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(k)] for k in prompt_lens]
    max_len = max(prompt_lens) + max(lens) + (NUM_TURNS - 1) * tool_len
    cfg = EngineConfig(max_model_len=max_len, max_num_seqs=max(len(lens), 2),
                       # on the CPU, KV for every conversation at its longest: no preemption, as on the GPU
                       **({"cpu_kv_tokens": max(1 << 14, len(lens) * (max_len + 64))} if device.type == "cpu" else {}))
    engine = Engine(model, NullTokenizer(), eos_token_ids=[], config=cfg)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "num_samples": len(lens), "num_generated_tokens": sum(lens), "tool_len": tool_len}
    multi = lambda: run_multi(engine, prompts, lens, n, tool_len, 1)   # noqa: E731
    for name, run in (("single_engine", lambda: run_single_engine(engine, prompts, lens, n, 1)),
                      ("single_front", lambda: run_single_front(engine, prompts, lens, n, 1)),
                      ("multi_turn", multi),
                      ("multi_turn_unmixed", lambda: with_scheduler(engine, multi, mix_prefill=False)),
                      ("multi_turn_admit_any", lambda: with_scheduler(engine, multi, min_admit=1))):
        run()                                   # warm-up: graph captures of every batch size
        engine.release()
        engine.reset_stats()
        result[f"{name}_seconds"] = run()
        stats = engine.reset_stats()
        result[f"{name}_prefill_tokens"] = stats.num_prefill_tokens
        result[f"{name}_cached_tokens"] = stats.num_cached_tokens
        result[f"{name}_generated_tokens"] = stats.num_generated_tokens
        # what the time is made of, device-independent: decode steps and rows, the context they attend to
        # (a multi-turn row's context holds its tool outputs too), and the prefill steps between turns
        result[f"{name}_decode_steps"] = stats.num_decode_steps
        result[f"{name}_decode_rows"] = stats.num_decode_rows
        result[f"{name}_context_tokens"] = stats.num_context_tokens
        result[f"{name}_prefill_steps"] = stats.num_prefill_steps
        result[f"{name}_mixed_steps"] = stats.num_mixed_steps         # of those, behind a decode window
        result[f"{name}_decode_windows"] = stats.num_windows
        result[f"{name}_grouped_rows"] = stats.num_grouped_rows      # rows reading their prompt once per group
        result[f"{name}_engine_seconds"] = stats.seconds              # inside Engine.step (the rest: the front)
        result[f"{name}_prefill_seconds"] = stats.prefill_seconds
        engine.release()
    result["ratio_vs_single_engine"] = result["multi_turn_seconds"] / result["single_engine_seconds"]
    result["ratio_vs_single_front"] = result["multi_turn_seconds"] / result["single_front_seconds"]
    for name in ("unmixed", "admit_any"):
        result[f"{name}_ratio_vs_single_engine"] = result[f"multi_turn_{name}_seconds"] / result["single_engine_seconds"]
    result["context_ratio_vs_single_engine"] = (result["multi_turn_context_tokens"]
                                                / max(result["single_engine_context_tokens"], 1))
    text = json.dumps(result, indent=1)
    print(text)
    if a.output:
        Path(a.output).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
