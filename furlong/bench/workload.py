"""The bench workload file (bench/seed_workload.json): parsing, validation, part names.

The file fixes the model config (an HF config.json), prompt lengths, forced
response lengths, train settings and a decode probe. Bad input raises
ValueError naming the file and the missing/inconsistent key; the model config
is validated with ModelArgs at load time, so a bad one fails before any part runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from furlong.models.hf_config import ModelArgs

# budget last: its out-of-memory rows can leave the allocator fragmented for later parts;
# trl (minutes of HF generate) after the engine's parts, so a short `all` run still gets those
PART_ORDER = ("train", "hf", "rollout", "decode", "eval", "rlstep", "trl", "budget", "ref")
DEFAULT_BUDGETS = [32768, 65536, 131072, 200000]


@dataclass
class Workload:
    name: str
    model: dict[str, Any]          # HF config.json fields
    prompt_lens: list[int]         # [num_prompts]
    response_lens: list[int]       # [num_prompts * n_samples]; sample i answers prompt i // n_samples
    n_samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    global_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int
    optimizer: str
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    eps_clip: float
    eps_clip_high: float
    update_weight_buffer_size: int  # bytes per weight-sync bucket
    budgets: list[int]              # --max-tokens-per-gpu values of the budget sweep
    compare_mbs1: bool              # train part: also time the step at --micro-batch-size 1
    decode_batch: int
    decode_prompt_len: int
    decode_new_tokens: int
    hf_max_seconds: float           # cap on the HF generate run of the decode probe
    eval_num_prompts: int           # eval probe: prompts (lengths cycle through prompt_lens), greedy
    eval_max_new_tokens: int
    trl_micro_batch_size: int       # trl part: TRL's per_device_train_batch_size (divides num_samples)
    trl_warmup_steps: int           # trl part: untimed TRL steps first
    trl_timed_steps: int            # trl part: TRL steps in the median
    rlstep_num_steps: int           # rlstep part: RL steps per mode (without, with --partial-rollout)
    rlstep_over_sampling: int       # rlstep part: --over-sampling-batch-size (default twice the prompts)
    rlstep_zero_std_every: int      # rlstep part: every k-th prompt's group gets equal rewards (filtered out)

    @property
    def num_samples(self) -> int:
        return len(self.response_lens)

    def sample_lengths(self) -> list[int]:
        """Prompt + response tokens of each sample [num_samples]."""
        n = self.n_samples_per_prompt
        return [self.prompt_lens[i // n] + r for i, r in enumerate(self.response_lens)]

    def first_micro_batch(self, budget: int) -> list[tuple[int, int]]:
        """(prompt, response) tokens of the samples, in order, that fit in `budget` tokens: the shape of
        one packed micro-batch for kernel-level benches."""
        n, out, total = self.n_samples_per_prompt, [], 0
        for i, r in enumerate(self.response_lens):
            p = self.prompt_lens[i // n]
            if total + p + r > budget:
                break
            out.append((p, r))
            total += p + r
        return out


def load_workload(path: str | Path) -> Workload:
    """Parse a workload JSON; ValueError names the file and key."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--workload: {path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--workload: {path} is not valid JSON ({e})") from None

    def get(section: str, key: str, default: Any = ...) -> Any:
        block = raw.get(section)
        if not isinstance(block, dict) or (key not in block and default is ...):
            raise ValueError(f"--workload: {path}: missing key {section}.{key}")
        return block.get(key, default)

    if not isinstance(raw.get("model"), dict):
        raise ValueError(f"--workload: {path}: missing key 'model' (an HF config)")
    n = int(get("rollout", "n_samples_per_prompt"))
    prompt_lens = [int(x) for x in get("rollout", "prompt_lens")]
    response_lens = [int(x) for x in get("rollout", "response_lens")]
    if n < 1 or not prompt_lens or len(response_lens) != len(prompt_lens) * n:
        raise ValueError(f"--workload: {path}: rollout.response_lens has {len(response_lens)} entries, "
                         f"expected len(prompt_lens) * n_samples_per_prompt = {len(prompt_lens) * n}")
    if min(prompt_lens + response_lens) < 1:
        raise ValueError(f"--workload: {path}: rollout.prompt_lens/response_lens must be >= 1")
    eps = float(get("train", "eps_clip", 0.2))
    w = Workload(
        name=str(raw.get("name", path.stem)), model=raw["model"], prompt_lens=prompt_lens,
        response_lens=response_lens, n_samples_per_prompt=n,
        temperature=float(get("rollout", "temperature", 1.0)), top_p=float(get("rollout", "top_p", 1.0)),
        top_k=int(get("rollout", "top_k", -1)),
        global_batch_size=int(get("train", "global_batch_size", len(response_lens))),
        use_dynamic_batch_size=bool(get("train", "use_dynamic_batch_size", True)),
        max_tokens_per_gpu=int(get("train", "max_tokens_per_gpu")), optimizer=str(get("train", "optimizer", "adam")),
        lr=float(get("train", "lr", 1e-6)), weight_decay=float(get("train", "weight_decay", 0.0)),
        adam_beta1=float(get("train", "adam_beta1", 0.9)), adam_beta2=float(get("train", "adam_beta2", 0.95)),
        eps_clip=eps, eps_clip_high=float(get("train", "eps_clip_high", eps)),
        update_weight_buffer_size=int(get("train", "update_weight_buffer_size", 512 * 1024**2)),
        budgets=[int(b) for b in get("train", "budget_sweep", DEFAULT_BUDGETS)],
        compare_mbs1=bool(get("train", "compare_micro_batch_size_1", True)),
        decode_batch=int(get("decode_probe", "batch")), decode_prompt_len=int(get("decode_probe", "prompt_len")),
        decode_new_tokens=int(get("decode_probe", "new_tokens")),
        hf_max_seconds=float(get("decode_probe", "hf_max_seconds", 60.0)),
        eval_num_prompts=int(raw.get("eval_probe", {}).get("num_prompts", 1319)),
        eval_max_new_tokens=int(raw.get("eval_probe", {}).get("max_new_tokens", 1024)),
        # default 16 rows (16 x 16 = the seed step's 256), or a divisor of a smaller step's samples
        trl_micro_batch_size=int(raw.get("trl_probe", {}).get("micro_batch_size", math.gcd(16, len(response_lens)))),
        trl_warmup_steps=int(raw.get("trl_probe", {}).get("warmup_steps", 2)),
        trl_timed_steps=int(raw.get("trl_probe", {}).get("timed_steps", 3)),
        rlstep_num_steps=int(raw.get("rl_step_probe", {}).get("num_steps", 3)),
        rlstep_over_sampling=int(raw.get("rl_step_probe", {}).get("over_sampling_batch_size", 2 * len(prompt_lens))),
        rlstep_zero_std_every=int(raw.get("rl_step_probe", {}).get("zero_std_every", 4)),
    )
    if w.rlstep_num_steps < 1 or w.rlstep_over_sampling < 1 or w.rlstep_zero_std_every < 2:
        raise ValueError(f"--workload: {path}: rl_step_probe needs num_steps >= 1, over_sampling_batch_size >= 1 "
                         "and zero_std_every >= 2")
    if w.trl_micro_batch_size < 1 or w.num_samples % w.trl_micro_batch_size:
        raise ValueError(f"--workload: {path}: trl_probe.micro_batch_size ({w.trl_micro_batch_size}) must divide "
                         f"the {w.num_samples} samples of the step (one TRL optimizer step per rollout)")
    if w.trl_warmup_steps < 0 or w.trl_timed_steps < 1:
        raise ValueError(f"--workload: {path}: trl_probe.warmup_steps must be >= 0 and timed_steps >= 1")
    ModelArgs.from_hf_config(w.model, source=f"{path}: model")   # validates the config now
    return w


def parse_parts(parts: str) -> list[str]:
    names = list(PART_ORDER) if parts.strip() == "all" else [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in names if p not in PART_ORDER]
    if bad or not names:
        raise ValueError(f"--parts: unknown part(s) {bad} (all, or a comma list of {', '.join(PART_ORDER)})")
    return [p for p in PART_ORDER if p in names]
