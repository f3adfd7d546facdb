"""Step 1 of a run's set-up: every input checked (and the prompt sets tokenized) before anything is written.

The "nothing written half-way" rule: config.json, safetensors headers, tokenizer, stop token ids,
data files, reward and filter paths, the --load checkpoint and the writable output dirs are all
checked here, before setup.build_run loads a model or creates the output directory; flag
values were checked before that by config_checks.validate. Every failure is a ValueError naming its flag.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from furlong.config import Config
from furlong.config_map import rollout_seed
from furlong.config_train_flags import num_rollouts, resolve_num_rollout
from furlong.run.reference import ReferenceSource, check_reference
from furlong.checkpoint.verify import CheckpointChoice, choose_checkpoint
from furlong.run.identity import RunDirs, plan_run_dirs
from furlong.types import Prompt, Sample

if TYPE_CHECKING:   # heavy imports (transformers, the data readers) only where a run needs them
    from transformers import PreTrainedTokenizerBase

    from furlong.data import PromptDataset
    from furlong.models.hf_config import ModelArgs
    from furlong.rollout.eval import EvalSet
    from furlong.rollout.filters import GroupFilter
    from furlong.run.user_functions import RolloutFunctions, UserFunctions


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


def load_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerBase:
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


def check_hf_checkpoint(path: str | None) -> tuple[Path, ModelArgs, PreTrainedTokenizerBase]:
    """The --hf-checkpoint directory, its ModelArgs and tokenizer, after every check of them (config.json
    keys and types, safetensors headers against the config, tokenizer files); nothing is written."""
    from furlong.models.hf_io import check_pretrained
    ckpt = check_checkpoint_dir(path)
    args, _ = check_pretrained(ckpt)
    return ckpt, args, load_tokenizer(ckpt, args.vocab_size)


def default_output_dir(cfg: Config) -> Path:
    return Path(cfg.log.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")


def nothing_saved_yet(cfg: Config) -> bool:
    """--load is the run's own --save and holds no checkpoint yet: the run starts fresh (the first launch
    of a run that torchrun may restart with the same command; Megatron/miles start fresh from an empty
    --load too). Any other --load without a checkpoint is refused."""
    from furlong.checkpoint.verify import TRACKER
    c = cfg.ckpt
    return (c.load is not None and c.save is not None and c.ckpt_step is None
            and Path(c.load).resolve() == Path(c.save).resolve() and not (Path(c.load) / TRACKER).exists())


@dataclass
class CheckedInputs:
    """A run's inputs after every check; nothing has been written yet."""
    hf_checkpoint: Path                        # --hf-checkpoint dir (config, weights, tokenizer checked)
    model_args: ModelArgs
    tokenizer: PreTrainedTokenizerBase
    max_response_len: int                      # longest response of rollout or eval: the engine's budget
    dataset: PromptDataset | None              # the training prompts (None for eval only)
    eval_sets: list[EvalSet]                   # --eval-config / --eval-prompt-data sets, with prompts and reward
    reward_fn: Callable[[Sample], float]       # bounded by --reward-timeout
    filter_fn: GroupFilter | None              # --dynamic-sampling-filter-path
    resume: CheckpointChoice | None            # the --load iteration to restore
    output_dir: Path
    critic_checkpoint: Path | None             # HF dir the critic starts from (ppo only)
    critic_model_args: ModelArgs | None        # its decoder (ppo only)
    run_dirs: RunDirs                          # run id, and what a new run clears (run/identity.py)
    functions: RolloutFunctions | None = None  # custom generate / rollout functions (None: none given)
    config: Config | None = None               # the flags with --num-epoch resolved into --num-rollout
    reference: ReferenceSource | None = None   # where the frozen reference model's weights come from

    def prompts(self) -> list[Prompt]:
        return [p for es in self.eval_sets for p in es.prompts] + (self.dataset.all() if self.dataset is not None else [])


def check_inputs(cfg: Config, with_actor: bool, user: UserFunctions | None = None) -> CheckedInputs:
    """Step 1 of build_run (module docstring); `with_actor` False for `furlong eval`; `user`: the
    Python API's callables (run/user_functions.py). Under --debug-rollout-only a training run has no
    trainer: no reference, critic or save directories are checked, and a --load checkpoint is one for
    the engine (as for `furlong eval`)."""
    trains = with_actor and not cfg.debug.debug_rollout_only
    from furlong.config_checks import chat_template_kwargs
    from furlong.eval_set_map import eval_set_configs
    from furlong.rewards.run_rewards import eval_reward_key, make_reward
    from furlong.run.user_functions import load_user_functions
    from furlong.data import PromptDataset
    from furlong.lora_flags import check_checkpoint_model
    from furlong.rollout.eval import EvalSet
    from furlong.rollout.filters import load_filter

    ckpt, args, tokenizer = check_hf_checkpoint(cfg.data.hf_checkpoint)
    bad_ids = [i for i in cfg.rollout.rollout_stop_token_ids if not 0 <= i < args.vocab_size]
    if bad_ids:
        raise ValueError(f"--rollout-stop-token-ids: {bad_ids[0]} is not a token id of the model "
                         f"(vocab_size {args.vocab_size})")
    set_configs = eval_set_configs(cfg, rollout_seed(cfg))
    max_resp = max([cfg.rollout.rollout_max_response_len] + [c.sampling.max_new_tokens for c in set_configs])
    max_ctx = args.max_position_embeddings - max_resp
    if max_ctx <= 0:
        raise ValueError(f"--rollout-max-response-len: {max_resp} leaves no room for a prompt in the model's "
                         f"context of {args.max_position_embeddings}")
    max_prompt_len, ctx_len = cfg.data.rollout_max_prompt_len, cfg.rollout.rollout_max_context_len
    if ctx_len is not None:
        if ctx_len > args.max_position_embeddings:
            raise ValueError(f"--rollout-max-context-len: {ctx_len} exceeds the model's context of "
                             f"{args.max_position_embeddings}")
        # miles: prompts leave at least one token of room for the response
        max_prompt_len = ctx_len - 1 if max_prompt_len is None else min(max_prompt_len, ctx_len - 1)
    common = dict(tokenizer=tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                  max_prompt_len=max_prompt_len, max_context_len=max_ctx, tool_key=cfg.data.tool_key,
                  metadata_key=cfg.data.metadata_key, chat_template_kwargs=chat_template_kwargs(cfg))
    dataset = None
    if with_actor:
        dataset = PromptDataset(cfg.data.prompt_data, input_key=cfg.data.input_key, label_key=cfg.data.label_key,
                                shuffle=cfg.data.rollout_shuffle, seed=rollout_seed(cfg), **common)
        # miles sets num_rollout from the data size (--num-epoch); every later reader sees the resolved value
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, num_rollout=resolve_num_rollout(cfg, len(dataset))))
    user_reward = user.reward if user is not None else None
    eval_sets = []
    for sc in set_configs:   # each set's own keys, prompt limit and reward (eval_set_map.py)
        try:
            ds = PromptDataset(sc.path, input_key=sc.input_key, label_key=sc.label_key, shuffle=False, seed=0,
                               **{**common, "max_prompt_len": sc.max_prompt_len, "tool_key": sc.tool_key,
                                  "metadata_key": sc.metadata_key})
        except ValueError as e:   # the limit an eval set's prompts were held to is --eval-max-prompt-len's
            if cfg.eval_set.eval_max_prompt_len is None:
                raise
            raise type(e)(str(e).replace("--rollout-max-prompt-len", "--eval-max-prompt-len")) from None
        prompts = [dataclasses.replace(p, metadata={**p.metadata, **sc.metadata_overrides}) for p in ds.all()]
        eval_sets.append(EvalSet(sc, prompts, make_reward(cfg, user_reward, eval_reward_key(cfg), sc.rm_type)))
    reward_fn = make_reward(cfg, user_reward, cfg.reward.reward_key)
    functions = load_user_functions(cfg, user)
    filter_fn = load_filter(cfg.rollout.dynamic_sampling_filter_path)
    resume = None
    if cfg.ckpt.load is not None and not nothing_saved_yet(cfg):
        resume = choose_checkpoint(cfg.ckpt.load, cfg.ckpt.ckpt_step, None)
        check_checkpoint_model(resume, args, cfg, trains)   # the model's names and shapes, LoRA or not
        if with_actor and cfg.length.start_rollout_id is None and resume.iteration > cfg.rollout.num_rollout:
            raise ValueError(f"--num-rollout: {cfg.rollout.num_rollout} is below the {resume.iteration} rollouts "
                             f"already done by {resume.path}")
    start = cfg.length.start_rollout_id
    if with_actor and start is not None and start >= num_rollouts(cfg):
        raise ValueError(f"--start-rollout-id: {start} leaves no rollout of --num-rollout {num_rollouts(cfg)} to run")
    reference = check_reference(cfg, args, resume) if trains else None
    out = default_output_dir(cfg)
    check_writable(out, "--output-dir")
    if cfg.ckpt.save is not None and trains:
        check_writable(cfg.ckpt.save, "--save")
    critic_ckpt = critic_args = None
    if trains and cfg.algo.advantage_estimator == "ppo":
        critic_ckpt, critic_args = check_critic_inputs(cfg, ckpt, args, resume.iteration if resume is not None else None)
    run_dirs = check_run_dirs(cfg, out, with_actor and critic_ckpt is not None) if with_actor else \
        plan_run_dirs(out, [], None, cfg.log.overwrite)   # eval: a run directory of its own
    return CheckedInputs(hf_checkpoint=ckpt, model_args=args, tokenizer=tokenizer, max_response_len=max_resp,
                         dataset=dataset, eval_sets=eval_sets, reward_fn=reward_fn, filter_fn=filter_fn,
                         resume=resume, output_dir=out, critic_checkpoint=critic_ckpt,
                         critic_model_args=critic_args, run_dirs=run_dirs,
                         functions=functions, config=cfg, reference=reference)


def check_run_dirs(cfg: Config, out: Path, with_critic: bool) -> RunDirs:
    """--output-dir and the save directories against the run's id (run/identity.py)."""
    from furlong.config_map import checkpoint_config
    paths = checkpoint_config(cfg)
    saves = [] if paths.save is None or cfg.debug.debug_rollout_only else [("--save", paths.save, paths.load)]
    if with_critic and paths.critic_save is not None:
        saves.append(("--critic-save", paths.critic_save, paths.critic_load))
    return plan_run_dirs(out, saves, cfg.ckpt.load, cfg.log.overwrite)


def check_critic_inputs(cfg: Config, hf_checkpoint: Path, args: ModelArgs,
                        resume_iteration: int | None) -> tuple[Path, ModelArgs]:
    """The critic's inputs (ppo): the HF checkpoint it starts from and its ModelArgs (returned; the
    actor's `hf_checkpoint` and `args` unless --critic-hf-checkpoint), which must share the actor's
    vocabulary since it reads the actor's token ids; on resume, its checkpoint of the actor's
    iteration; --critic-save."""
    from furlong.models.hf_config import ModelArgs
    from furlong.checkpoint.critic import check_critic_resume
    from furlong.config_map import checkpoint_config
    path, paths, critic_args = hf_checkpoint, checkpoint_config(cfg), args
    vocab_size = args.vocab_size
    if cfg.algo.critic_hf_checkpoint is not None:
        try:
            path = check_checkpoint_dir(cfg.algo.critic_hf_checkpoint)
        except ValueError as e:
            raise ValueError(str(e).replace("--hf-checkpoint", "--critic-hf-checkpoint", 1)) from e
        critic_args = ModelArgs.from_dir(path)
        critic_vocab = critic_args.vocab_size
        if critic_vocab != vocab_size:
            raise ValueError(f"--critic-hf-checkpoint: vocab_size {critic_vocab} differs from the --hf-checkpoint "
                             f"model's {vocab_size} (the critic reads the actor's token ids)")
    if resume_iteration is not None:
        check_critic_resume(paths.critic_load, resume_iteration)
    if paths.critic_save is not None:
        check_writable(paths.critic_save, "--critic-save")
    return path, critic_args
