"""Builds the parts of a run from a Config: inputs first, then models, then outputs.

Order matters for the "nothing written half-way" rule: every input (config.json,
safetensors headers, tokenizer, stop token ids, data files, reward and filter
paths, the --load checkpoint, writable output dirs) is checked in step 1 of
`build_run`, before the output directory is created; flag values were checked
before that by config.validate.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from furlong.config import Config
from furlong.metrics import MetricsLogger
from furlong.train.checkpoint_verify import choose_checkpoint
from furlong.train.fsdp import compute_dtype
from furlong.types import Prompt, Sample


def check_checkpoint_dir(path: str | None) -> Path:
    if path is None:
        raise ValueError("--hf-checkpoint: required")
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--hf-checkpoint: {p} is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"--hf-checkpoint: {p / 'config.json'} is missing")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"--hf-checkpoint: no *.safetensors weights in {p}")
    return p


def check_writable(path: str | os.PathLike, flag_name: str) -> None:
    """ValueError naming the flag unless `path` is (or can be created as) a writable directory.
    The path itself, or its nearest existing ancestor, gets an empty directory made and removed at
    once: permission bits say nothing for root, a read-only mount or /proc, a real attempt does."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag_name}: {p} exists and is not a directory")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag_name}: cannot create {p}: {probe} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".furlong-probe-", dir=probe))
    except OSError as e:
        raise ValueError(f"{flag_name}: cannot create {p}: {probe} is not writable ({e.strerror})") from None


# one of these holds a tokenizer's vocabulary; without them transformers builds an empty tokenizer
VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def load_tokenizer(path: Path, vocab_size: int):
    from transformers import AutoTokenizer
    if not any((path / f).is_file() for f in VOCAB_FILES):
        raise ValueError(f"--hf-checkpoint: no tokenizer in {path} (none of {', '.join(VOCAB_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        probe = tokenizer.encode("1 + 1 = 2")
    except Exception as e:  # transformers raises many types for a broken tokenizer dir
        raise ValueError(f"--hf-checkpoint: cannot load the tokenizer from {path}: {e}".splitlines()[0]) from e
    if not probe:
        raise ValueError(f"--hf-checkpoint: the tokenizer in {path} encodes text to no tokens (files missing?)")
    if len(tokenizer) > vocab_size:
        raise ValueError(f"--hf-checkpoint: the tokenizer in {path} has {len(tokenizer)} tokens, more than "
                         f"config.json's vocab_size {vocab_size}")
    return tokenizer


def check_hf_checkpoint(path: str | None):
    """The --hf-checkpoint directory, its ModelArgs and tokenizer, after every check of them (config.json
    keys and types, safetensors headers against the config, tokenizer files); nothing is written."""
    from furlong.models.hf_io import check_pretrained
    ckpt = check_checkpoint_dir(path)
    args, _ = check_pretrained(ckpt)
    return ckpt, args, load_tokenizer(ckpt, args.vocab_size)


def eos_token_ids(path: Path, tokenizer) -> list[int]:
    """EOS ids: the tokenizer's eos plus generation_config.json's (Qwen lists several)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        for x in (e if isinstance(e, list) else [e]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))
    return ids


def default_output_dir(cfg: Config) -> Path:
    return Path(cfg.log.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")


def write_eval_samples(output_dir: Path, name: str, rollout_id: int, samples: list[Sample],
                       prefix: str = "eval") -> None:
    d = output_dir / "samples"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{prefix}_{name}_{rollout_id + 1}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps({"prompt": s.prompt.text, "response": s.response_text, "label": s.prompt.label,
                                "reward": s.reward, "finish_reason": s.finish_reason}) + "\n")
    os.replace(tmp, path)


@dataclass
class RunParts:
    cfg: Config
    ctx: Any                                   # DistContext
    output_dir: Path
    logger: MetricsLogger
    dataset: Any                               # PromptDataset
    eval_sets: list[tuple[str, list[Prompt]]]
    engine: Any                                # furlong.engine.Engine (its own model copy)
    reward_fn: Callable[[Sample], float]
    filter_fn: Callable | None
    actor: Any | None                          # train.actor.Actor (None for eval only)
    start_rollout: int
    num_params: int
    critic: Any | None = None                  # train.critic.Critic (ppo only)

    def rollout(self, rollout_id: int):
        """One rollout; the engine's KV cache is freed after it (colocated: the trainer needs it)."""
        from furlong.rollout.rollout import RolloutSpec, generate_rollout
        try:
            return generate_rollout(self.dataset, self.engine, self.reward_fn, self.filter_fn,
                                    RolloutSpec.from_config(self.cfg), self.rank_info(), rollout_id)
        finally:
            self.engine.release()

    def rank_info(self):
        from furlong.rollout.rollout import RankInfo
        return RankInfo(rank=self.ctx.rank, world_size=self.ctx.world_size)

    def run_eval(self, name: str, prompts: list[Prompt]):
        from furlong.rollout.eval import run_eval
        from furlong.engine.sampling import SamplingParams
        params = SamplingParams.for_eval(self.cfg, seed=self.cfg.data.rollout_seed)
        try:
            return run_eval(name, prompts, self.engine, self.reward_fn, params,
                            self.cfg.eval.n_samples_per_eval_prompt, self.rank_info())
        finally:
            self.engine.release()

    def sync_weights(self) -> None:
        from furlong.train.weight_sync import sync_weights
        sync_weights(self.actor.model, self.engine.model, self.cfg.batch.update_weight_buffer_size)

    def save(self, rollout_id: int) -> None:
        from furlong.train.checkpoint import save_checkpoint
        if self.critic is not None:   # first: a complete actor iter_N then implies the critic's
            from furlong.train.critic_checkpoint import save_critic
            save_critic(self.cfg, self.critic, rollout_id)
        path = save_checkpoint(self.cfg.ckpt.save, self.actor, rollout_id, sampler_state=self.dataset.state_dict())
        self.logger.line(f"saved checkpoint {path} (after rollout {rollout_id + 1})")

    def mfu(self, num_tokens: int, seconds: float) -> float:
        """Training MFU: 6*N FLOPs per token over the peak of the GPUs in use (train/mfu.py)."""
        from furlong.train.mfu import mfu
        return mfu(self.num_params, num_tokens, seconds, self.ctx.device, self.ctx.world_size)


def build_run(cfg: Config, ctx, with_actor: bool) -> RunParts:
    from furlong.data import PromptDataset
    from furlong.models.hf_io import load_pretrained, param_shapes
    from furlong.rewards.registry import TimedReward, get_reward_fn
    from furlong.rollout.filters import load_filter
    from furlong.engine import Engine, EngineConfig

    # 1. inputs (nothing written yet)
    ckpt, args, tokenizer = check_hf_checkpoint(cfg.data.hf_checkpoint)
    bad_ids = [i for i in cfg.rollout.rollout_stop_token_ids if not 0 <= i < args.vocab_size]
    if bad_ids:
        raise ValueError(f"--rollout-stop-token-ids: {bad_ids[0]} is not a token id of the model "
                         f"(vocab_size {args.vocab_size})")
    max_resp = cfg.rollout.rollout_max_response_len
    if cfg.eval_sets():
        max_resp = max(max_resp, cfg.eval_sampling()["max_new_tokens"])
    max_ctx = args.max_position_embeddings - max_resp
    if max_ctx <= 0:
        raise ValueError(f"--rollout-max-response-len: {max_resp} leaves no room for a prompt in the model's "
                         f"context of {args.max_position_embeddings}")
    common = dict(tokenizer=tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                  max_prompt_len=cfg.data.rollout_max_prompt_len, max_context_len=max_ctx)
    dataset = None
    if with_actor:
        dataset = PromptDataset(cfg.data.prompt_data, input_key=cfg.data.input_key, label_key=cfg.data.label_key,
                                shuffle=cfg.data.rollout_shuffle, seed=cfg.data.rollout_seed, **common)
    eval_sets = []
    for name, path in cfg.eval_sets():
        ds = PromptDataset(path, input_key=cfg.eval.eval_input_key or cfg.data.input_key,
                           label_key=cfg.eval.eval_label_key or cfg.data.label_key, shuffle=False,
                           seed=0, **common)
        eval_sets.append((name, ds.all()))
    prompt_pool = [p for _, prompts in eval_sets for p in prompts] + (dataset.all() if dataset is not None else [])
    reward_fn = TimedReward(get_reward_fn(cfg.reward.rm_type, cfg.reward.custom_rm_path), cfg.reward.reward_timeout)
    filter_fn = load_filter(cfg.rollout.dynamic_sampling_filter_path)
    resume = None
    if cfg.ckpt.load is not None:
        resume = choose_checkpoint(cfg.ckpt.load, cfg.ckpt.ckpt_step, param_shapes(args))
        if with_actor and resume.iteration > cfg.rollout.num_rollout:
            raise ValueError(f"--num-rollout: {cfg.rollout.num_rollout} is below the {resume.iteration} rollouts "
                             f"already done by {resume.path}")
    out = default_output_dir(cfg)
    check_writable(out, "--output-dir")
    if cfg.ckpt.save is not None:
        check_writable(cfg.ckpt.save, "--save")
    critic_ckpt = None
    if with_actor and cfg.algo.advantage_estimator == "ppo":
        from furlong.train.critic import check_critic_inputs
        critic_ckpt = check_critic_inputs(cfg, args.vocab_size, resume.iteration if resume is not None else None)
    if (out / "metrics.jsonl").exists() and cfg.ckpt.load is None and not cfg.log.overwrite:
        raise ValueError(f"--output-dir: {out} already holds a run (metrics.jsonl); pass --load to continue it "
                         "or --overwrite to replace it")

    # 2. models
    device = ctx.device
    dtype = compute_dtype(device, cfg.parallel.dtype)
    engine_model = load_pretrained(ckpt, dtype=dtype, device=device)
    if resume is not None and not with_actor:   # furlong eval --load: score the trained weights
        from furlong.train.checkpoint import load_model_weights
        load_model_weights(cfg.ckpt.load, engine_model, resume.iteration)
    num_params = sum(p.numel() for p in engine_model.parameters())
    r = cfg.rollout
    max_prompt_len = max(len(p.token_ids) for p in prompt_pool)
    engine = Engine(engine_model, tokenizer, eos_token_ids(ckpt, tokenizer), EngineConfig(
        kv_fraction=r.rollout_kv_fraction, max_num_seqs=r.rollout_max_num_seqs,
        decode_window=r.rollout_decode_window, max_model_len=max_prompt_len + max_resp,
        use_cuda_graphs=not r.rollout_enforce_eager))
    actor = critic = None
    if with_actor:
        from furlong.train.actor import Actor
        from furlong.train.memory_probe import CPU_DEFAULT_TOKENS, probe_max_tokens
        auto = cfg.max_tokens_per_gpu_is_auto
        from furlong.train.critic import actor_schedule_steps
        actor = Actor(load_pretrained(ckpt, dtype=torch.float32, device=device), cfg, ctx,
                      total_steps=actor_schedule_steps(cfg), max_tokens_per_gpu=CPU_DEFAULT_TOKENS if auto else None)
        if critic_ckpt is not None:   # before the probe, which then measures with the critic (and its AdamW state)
            from furlong.train.critic import build_critic
            critic = build_critic(cfg, ctx, critic_ckpt, max_tokens_per_gpu=CPU_DEFAULT_TOKENS if auto else None)
        if auto:   # measured with the engine's weights already resident, as in every later step
            reserved = sum(p.numel() * p.element_size() for p in engine_model.parameters())
            actor.max_tokens_per_gpu = probe_max_tokens(actor, reserved_bytes=reserved)
            if critic is not None:   # its activations per token are the actor's minus the log-prob chunks
                critic.max_tokens_per_gpu = actor.max_tokens_per_gpu
            if ctx.rank == 0:
                print(f"--max-tokens-per-gpu auto: chose {actor.max_tokens_per_gpu} tokens", flush=True)

    # 3. outputs (rank 0 writes)
    logger_enabled = ctx.rank == 0
    if logger_enabled:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.log.overwrite and cfg.ckpt.load is None and (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").unlink()
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
    wandb = None
    if cfg.log.use_wandb and logger_enabled:
        if cfg.log.wandb_key:
            os.environ["WANDB_API_KEY"] = cfg.log.wandb_key
        name = out.name if cfg.log.disable_wandb_random_suffix else f"{out.name}-{os.urandom(3).hex()}"
        wandb = {"project": cfg.log.wandb_project, "group": cfg.log.wandb_group, "name": name,
                 "config": cfg.to_dict()}
    logger = MetricsLogger(out, enabled=logger_enabled, use_tensorboard=cfg.log.use_tensorboard,
                           wandb_settings=wandb)
    logger.line(f"run directory: {out}")
    if resume is not None and not with_actor:
        logger.line(f"evaluating iteration {resume.iteration} of {cfg.ckpt.load} ({resume.path})")

    parts = RunParts(cfg=cfg, ctx=ctx, output_dir=out, logger=logger, dataset=dataset, eval_sets=eval_sets,
                     engine=engine, reward_fn=reward_fn, filter_fn=filter_fn, actor=actor,
                     start_rollout=0, num_params=num_params, critic=critic)
    if resume is not None and actor is not None:
        from furlong.train.checkpoint import load_checkpoint
        state = load_checkpoint(cfg.ckpt.load, actor, resume.iteration)
        if critic is not None:
            from furlong.train.critic_checkpoint import load_critic
            load_critic(cfg, critic, resume.iteration)
        dataset.load_state_dict(state.sampler_state)
        parts.start_rollout = state.rollout_id + 1
        parts.sync_weights()
        dropped = logger.cut_back(state.rollout_id)
        logger.line(f"resumed from iteration {resume.iteration} ({state.path}; rollout {state.rollout_id + 1} "
                    f"done); {dropped} metrics line(s) after it dropped from {out / 'metrics.jsonl'}")
    return parts
