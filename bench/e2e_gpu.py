"""GPU end-to-end check (issue: the whole RL loop on GPU): the reference flag block on
one GPU for a few rollouts, on a random-weight Qwen3-0.6B-shaped checkpoint.

Usage (on the device, repo root): python3 bench/e2e_gpu.py DATA_DIR WORK_DIR [extra train flags]
DATA_DIR holds GSM8K train.jsonl/test.jsonl. A random model never scores on math,
so the dynamic-sampling filter would drop every group: the run adds
--custom-rm-path bench.e2e_gpu.hash_reward (a deterministic pseudo-reward of the
response text) and a CI threshold of 0; everything else is the reference block.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import sys
from pathlib import Path

REFERENCE = """
--prompt-data {data}/train.parquet --input-key messages --label-key label
--apply-chat-template --rollout-shuffle --rm-type math
--num-rollout 60 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 1024 --rollout-temperature 1
--over-sampling-batch-size 64
--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--global-batch-size 256
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.98
--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl
--kl-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
--rollout-num-gpus-per-engine 1 --sglang-decode-log-interval 1000 --sglang-enable-metrics
--eval-interval 20 --eval-prompt-data gsm8k {data}/test.parquet@[:256]
--n-samples-per-eval-prompt 1 --eval-max-response-len 1024 --eval-top-k 1
--update-weight-buffer-size 536870912
--use-dynamic-batch-size --max-tokens-per-gpu 32768
--ci-test --ci-disable-kl-checker --ci-metric-checker-key eval/gsm8k
--ci-metric-checker-threshold 0.0
--actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --train-backend fsdp
"""


def hash_reward(sample) -> float:
    """Deterministic pseudo-reward in {0, 1} from the response text (varies within a group)."""
    return float(hashlib.sha256(sample.response_text.encode()).digest()[0] & 1)


def make_checkpoint(workload: Path, out: Path, corpus_file: Path) -> Path:
    import torch

    from furlong.models.decoder import Transformer
    from furlong.models.hf_config import ModelArgs
    from furlong.models.hf_io import save_hf
    from furlong.tasks.tokenizer import build_tokenizer

    cfg = json.loads(workload.read_text())["model"]
    texts = [json.loads(line)["question"] for line in corpus_file.read_text().splitlines()[:3000]]
    tok_dir = build_tokenizer(texts, out.parent / "tokenizer", vocab_size=2048)
    args = ModelArgs.from_hf_config(cfg)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0.02)
    return save_hf(model.to(torch.bfloat16), args, out, tokenizer_src=tok_dir)


def main() -> int:
    data_in, work = Path(sys.argv[1]), Path(sys.argv[2])
    extra = sys.argv[3:]
    from furlong.cli import main as cli
    from furlong.tasks.gsm8k import prepare_gsm8k
    work.mkdir(parents=True, exist_ok=True)
    prepare_gsm8k(data_in, work / "gsm8k")
    ckpt = make_checkpoint(Path("bench/seed_workload.json"), work / "qwen3-0.6b-random", data_in / "train.jsonl")
    flags = shlex.split(REFERENCE.format(data=work / "gsm8k"))
    flags += ["--hf-checkpoint", str(ckpt), "--custom-rm-path", "bench.e2e_gpu.hash_reward"] + extra
    return cli(["train"] + flags)


if __name__ == "__main__":
    sys.exit(main())
