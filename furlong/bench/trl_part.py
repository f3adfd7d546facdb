"""Bench part `trl`: TRL's GRPOTrainer and furlong's whole step side by side, same shape, same run.

  trl   TRL's `GRPOTrainer` with its default rollout (transformers `generate`, no vLLM) on the
        step's shape: the workload's prompts x n_samples_per_prompt completions, all of them
        generated at once and used for exactly one optimizer step (per_device_train_batch_size
        x gradient_accumulation_steps = num_samples, so TRL reuses the sampling log-probs as
        furlong does); beta 0 (no reference model), no gradient checkpointing, bf16 on CUDA.
        `warmup_steps` untimed steps, then the median of `timed_steps`. TRL cannot force a
        per-sample length, so every response on BOTH sides has one fixed length, the workload's
        mean response length (TRL: min_new_tokens = max_completion_length keeps EOS out;
        furlong: ignore_eos). furlong's step at that length reuses the `rollout` and `train`
        parts' code on the workload with its response lengths replaced.

TRL and datasets are not furlong dependencies: they are imported here, and a missing one
fails this part alone with a one-line message. Weights: TRL's model is build_hf_model's copy
of the engine, which holds the actor's weights after furlong's side ran (its weight sync): the
same seeded random weights, a few lr-1e-6 steps on.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import statistics
import tempfile
from typing import Any

import torch

from furlong.bench.generation_parts import part_rollout
from furlong.bench.measure import PartTimeout, free_memory, peak_gib, reset_peak, sync
from furlong.bench.report import PartReport, StepSummary, TrlResult, step_summary
from furlong.bench.state import Bench, build_hf_model
from furlong.bench.train_parts import part_train

MISSING = "trl part: pip install trl datasets (on the device: carry the wheels, see bench/README.md)"


def word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer whose vocab is the words t0..t{V-1}, one id each, split on whitespace: a prompt
    of k words is exactly k tokens. eos = the last id, pad = the one before (no download needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{vocab_size - 1}",
                                   pad_token=f"t{vocab_size - 2}")


def _prompts(b: Bench, tok: Any) -> list[str]:
    """Random words with the workload's prompt lengths, special tokens (t0 and the last two) left out."""
    g = torch.Generator().manual_seed(b.seed + 5)
    texts = [" ".join(f"t{i}" for i in torch.randint(1, b.args.vocab_size - 2, (p,), generator=g).tolist())
             for p in b.w.prompt_lens]
    got = [len(ids) for ids in tok(texts)["input_ids"]]
    if got != list(b.w.prompt_lens):   # TRL tokenizes the text itself: the lengths must survive that
        raise RuntimeError(f"trl part: prompt token counts {got[:4]}... differ from the workload's")
    return texts


def _step_timer(device: torch.device) -> Any:
    """A TrainerCallback recording each optimizer step's seconds, the device synchronized at both ends.
    on_step_begin comes before the step's first micro-batch (whose _prepare_inputs generates the
    completions) and on_step_end after the optimizer step, so a step is generate + fwd/bwd + update."""
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.seconds.append(time.perf_counter() - self._t)
            print(f"[bench] trl: TRL step {len(self.seconds)} {self.seconds[-1]:.2f}s", flush=True)

    return StepTimer()


def _furlong_step(b: Bench, length: int) -> StepSummary:
    """furlong's whole step with every response `length` tokens: the rollout and train parts on a
    shallow copy of the run state whose workload has the fixed lengths (the run's own is untouched)."""
    b.engine()   # built before the copy, so both share it (and TRL's model copies its synced weights)
    fixed = copy.copy(b)
    fixed.w = dataclasses.replace(b.w, response_lens=[length] * b.w.num_samples, compare_mbs1=False)
    fixed.reports = {}
    try:
        fixed.reports["rollout"] = PartReport("rollout", "ok", result=part_rollout(fixed))
        fixed.reports["train"] = PartReport("train", "ok", result=part_train(fixed))
    finally:
        fixed.release_actor()   # TRL needs the memory
    return step_summary(fixed.reports)


def _grpo_config(b: Bench, length: int, out_dir: str) -> Any:
    from trl import GRPOConfig
    w, cuda = b.w, b.device.type == "cuda"
    return GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        max_steps=w.trl_warmup_steps + w.trl_timed_steps, seed=b.seed, bf16=cuda, fp16=False,
        gradient_checkpointing=False, use_vllm=False, beta=0.0,
        # one generation batch of every sample per optimizer step: TRL then skips its separate
        # old-log-prob forward (steps_per_generation == gradient_accumulation_steps)
        num_generations=w.n_samples_per_prompt, per_device_train_batch_size=w.trl_micro_batch_size,
        gradient_accumulation_steps=w.num_samples // w.trl_micro_batch_size,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length},   # EOS masked until `length`
        temperature=w.temperature, top_p=w.top_p, top_k=0 if w.top_k == -1 else w.top_k,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=w.weight_decay,
        adam_beta1=w.adam_beta1, adam_beta2=w.adam_beta2, max_grad_norm=b.config().optim.clip_grad,
        epsilon=w.eps_clip, epsilon_high=w.eps_clip_high, dataloader_num_workers=0)


def _require_trl() -> tuple[Any, Any]:
    """(trl, datasets), or the part's one-line install hint."""
    try:
        import datasets
        import trl
    except ImportError as e:
        raise RuntimeError(f"{MISSING} ({e})") from None
    return trl, datasets


def _run_trl(b: Bench, length: int) -> tuple[list[float], float | None, str]:
    """(seconds of every TRL step, peak GiB, note) of the warm-up + timed GRPOTrainer steps."""
    trl, datasets = _require_trl()
    w, dev = b.w, b.device
    tok = word_tokenizer(b.args.vocab_size)
    data = datasets.Dataset.from_dict({"prompt": _prompts(b, tok)})
    rng, lens = random.Random(b.seed + 6), set()

    def random_reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        lens.update(len(c) for c in completion_ids)   # TRL's completion lengths, checked after the run
        return [rng.random() for _ in completions]    # nonzero group std: advantages are not all 0

    timer = _step_timer(dev)
    hf = build_hf_model(b.engine(), w.model, b.dtype, dev)
    trainer = None
    with tempfile.TemporaryDirectory(prefix="furlong-bench-trl-") as out_dir:
        try:
            trainer = trl.GRPOTrainer(model=hf, reward_funcs=[random_reward], args=_grpo_config(b, length, out_dir),
                                      train_dataset=data, processing_class=tok, callbacks=[timer])
            # b.dtype weights: bf16 on CUDA, so TRL's AdamW runs in pure bf16, cheaper than furlong's
            # fp32 master weights (the ratio errs in TRL's favour)
            note = (f"TRL {trl.__version__}: transformers generate, {str(b.dtype).removeprefix('torch.')} weights and "
                    f"optimizer (furlong: fp32 master weights), loss_type {trainer.args.loss_type}, beta 0, "
                    "no gradient checkpointing, plain-text prompts, random rewards")
            reset_peak(dev)
            try:
                trainer.train()
            except PartTimeout:
                if len(timer.seconds) <= w.trl_warmup_steps:
                    raise
                note += (f"; the part's guard stopped TRL after {len(timer.seconds)} of "
                        f"{w.trl_warmup_steps + w.trl_timed_steps} steps: median of the timed ones done")
            peak = peak_gib(dev)
            if lens != {length}:
                raise RuntimeError(f"trl part: TRL completions of {sorted(lens)} tokens, expected {length} each")
        finally:
            if trainer is not None:
                trainer.accelerator.free_memory()   # drops its references to model and optimizer
            del trainer, hf
            free_memory(dev)
    return timer.seconds, peak, note


def part_trl(b: Bench) -> TrlResult:
    w = b.w
    if b.ctx.world_size > 1:
        raise RuntimeError("trl part: one process only (TRL is run here without its own launcher)")
    length = round(sum(w.response_lens) / w.num_samples)
    trl, _ = _require_trl()   # before furlong's side: a missing TRL fails in a second, not after a step
    ours = _furlong_step(b, length)
    print(f"[bench] trl: furlong step at {length} tokens per response: {ours.whole_step_s}s "
          f"(rollout {ours.rollout_s:.2f}, train {ours.train_step_s:.2f}, sync {ours.weight_sync_s})", flush=True)
    steps, peak, trl_note = _run_trl(b, length)
    timed = steps[w.trl_warmup_steps:]
    trl_s = statistics.median(timed)
    ratio = None if ours.whole_step_s is None else trl_s / ours.whole_step_s
    print(f"[bench] trl: TRL step {trl_s:.2f}s (median of {len(timed)}); furlong_over_trl "
          f"{ratio if ratio is None else round(ratio, 2)}", flush=True)
    return TrlResult(
        trl_version=trl.__version__, num_samples=w.num_samples, response_len=length,
        num_tokens=sum(w.prompt_lens) * w.n_samples_per_prompt + w.num_samples * length,
        micro_batch_size=w.trl_micro_batch_size, gradient_accumulation_steps=w.num_samples // w.trl_micro_batch_size,
        warmup_steps=w.trl_warmup_steps, timed_steps=len(timed), trl_steps_s=steps, trl_step_s=trl_s,
        trl_peak_gib=peak, furlong_rollout_s=ours.rollout_s, furlong_log_probs_s=ours.log_probs_s,
        furlong_train_step_s=ours.train_step_s, furlong_weight_sync_s=ours.weight_sync_s,
        furlong_step_s=ours.whole_step_s, furlong_over_trl=ratio,
        note=f"every response {length} tokens on both sides (the workload's mean; TRL: min_new_tokens = "
             f"max_completion_length, furlong: ignore_eos); furlong: rollout (a later session) + train_step + "
             f"weight sync; {trl_note}")
