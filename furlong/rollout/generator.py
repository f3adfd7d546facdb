"""Batched autoregressive generation with a static KV cache (DESIGN.md §2 step 1, §6).

Prompts are sorted by length (less padding), cut into batches of at most
`max_batch_size`, left-padded to the batch's longest prompt, prefilled in one
forward, then decoded one token per step for every row. Outputs come back in
the caller's order.

A row finishes at
  * an EOS token (`eos_token_ids`, unless `ignore_eos`) or one of
    `stop_token_ids`: the token is kept, finish_reason "stop";
  * a stop string: the response keeps every token up to and including the one
    that completes the string (that token may carry characters past the string);
    `text` is cut right after the stop string, so it ends with it; "stop";
  * `max_new_tokens` tokens: finish_reason "length".
Text is decoded with special tokens kept (an EOS shows up as e.g. `<|im_end|>`).

Host syncs: every `check_interval` steps (and at the last step) the new tokens
come to the host once, for the stop-string scan and for the "every row done?"
test that ends the batch early. Rows that finished keep being decoded until
then (their extra tokens are dropped), which costs < check_interval wasted steps
per batch but keeps the GPU queue full between checks.

Compaction: at a check, once at most `compact_ratio` of the batch's rows are
still running, the finished rows are taken out (their results kept) and the
KV cache, tokens and state shrink to the live rows, so a batch does not decode
its shortest responses for as long as its longest. Sampled tokens then come
from a smaller noise draw, so sampled outputs differ from an uncompacted run
(still seeded and deterministic); greedy outputs are identical. Skipped while
stop strings are scanned (the scanner keeps per-row history).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from furlong.rollout.kv_cache import StaticKVCache
from furlong.rollout.sampling import SamplingParams, sample_next


@dataclass
class Generation:
    token_ids: list[int]      # [R] response tokens, including the final EOS/stop token if any
    log_probs: list[float]    # [R] log-prob of each token under the sampling temperature (full vocab)
    text: str                 # decoded response, special tokens kept, cut after a stop string
    finish_reason: str        # "stop" | "length"


def _last_logits(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 cache: StaticKVCache) -> torch.Tensor:
    """Logits [B, V] at the last position; projects only that position when the model allows."""
    if hasattr(model, "hidden_states") and hasattr(model, "output_weight"):
        hidden = model.hidden_states(input_ids, position_ids, None, kv_cache=cache)[:, -1]   # [B, H]
        return F.linear(hidden, model.output_weight)
    return model(input_ids, position_ids, None, kv_cache=cache)[:, -1]


class Generator:
    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: list[int], max_batch_size: int,
                 device: torch.device | str, check_interval: int = 8, kv_bucket: int = 64,
                 compact_ratio: float = 0.75):
        if max_batch_size < 1:
            raise ValueError(f"Generator: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.check_interval = max(1, check_interval)
        self.kv_bucket = kv_bucket
        self.compact_ratio = compact_ratio
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt, in prompt order. Same params.seed -> same outputs."""
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"Generator.generate: prompt {i} is empty")
        rng = torch.Generator(device=self.device)
        if params.seed is None:
            rng.seed()
        else:
            rng.manual_seed(params.seed)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[Generation | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), self.max_batch_size):
                    idx = order[start:start + self.max_batch_size]
                    for i, g in zip(idx, self._generate_batch([prompts[i] for i in idx], params, rng)):
                        out[i] = g
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]

    def _stop_token_tensor(self, params: SamplingParams) -> torch.Tensor:
        ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        return torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        rng: torch.Generator) -> list[Generation]:
        model, dev = self.model, self.device
        args = model.args
        num_rows, prompt_len, max_new = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
        ids = torch.full((num_rows, prompt_len), self.pad_id, dtype=torch.long)
        valid = torch.zeros(num_rows, prompt_len, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, prompt_len - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[r, prompt_len - len(p):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        lengths = valid.sum(-1)                                           # [B] real prompt tokens
        dtype = next(model.parameters()).dtype
        cache = StaticKVCache(args.num_layers, num_rows, args.num_kv_heads, args.head_dim,
                              prompt_len + max_new, dtype, dev, bucket=self.kv_bucket)
        cache.begin_step(valid)
        logits = _last_logits(model, ids, (valid.long().cumsum(-1) - 1).clamp(min=0), cache)

        tokens = torch.zeros(num_rows, max_new, dtype=torch.long, device=dev)      # [B, max_new]
        log_probs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=dev)
        end = torch.full((num_rows,), max_new, dtype=torch.long, device=dev)       # [B] response length
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)              # [B]
        stop_ids = self._stop_token_tensor(params)
        scan = _StopStringScan(self.tokenizer, params.stop, num_rows)
        rows = list(range(num_rows))          # original row of each live slot
        out: list[Generation | None] = [None] * num_rows
        checked = 0   # steps already brought to the host
        for step in range(max_new):
            tok, lp = sample_next(logits, params, rng)
            tokens[:, step], log_probs[:, step] = tok, lp
            if stop_ids.numel():
                hit = torch.isin(tok, stop_ids) & ~stopped
                end = torch.where(hit, step + 1, end)
                stopped = stopped | hit
            last = step == max_new - 1
            if last or (step + 1) % self.check_interval == 0:
                # The one host sync per check_interval steps (see module docstring).
                if scan.active:
                    hits = scan.scan(tokens[:, checked:step + 1].tolist(), checked, end.tolist(),
                                     stopped.tolist())
                    for row, new_end in hits:
                        end[row], stopped[row] = new_end, True
                checked = step + 1
                stopped_h = stopped.tolist()
                if last or all(stopped_h):
                    break
                live = [i for i, done in enumerate(stopped_h) if not done]
                if not scan.active and len(live) <= self.compact_ratio * len(rows):
                    done = [i for i, d in enumerate(stopped_h) if d]
                    self._finish(done, rows, tokens, log_probs, end, stopped, checked, scan, params, out)
                    keep = torch.tensor(live, device=dev)
                    tokens, log_probs, end, stopped = tokens[keep], log_probs[keep], end[keep], stopped[keep]
                    tok, lengths = tok[keep], lengths[keep]
                    cache.keep_rows(keep)
                    rows = [rows[i] for i in live]
            cache.begin_step(torch.ones(len(rows), 1, dtype=torch.bool, device=dev))
            logits = _last_logits(model, tok[:, None], (lengths + step)[:, None], cache)
        self._finish(list(range(len(rows))), rows, tokens, log_probs, end, stopped, checked, scan, params, out)
        return out  # type: ignore[return-value]

    def _finish(self, slots: list[int], rows: list[int], tokens: torch.Tensor, log_probs: torch.Tensor,
                end: torch.Tensor, stopped: torch.Tensor, checked: int, scan: "_StopStringScan",
                params: SamplingParams, out: list) -> None:
        """Results of the live slots `slots` (their original rows: rows[slot]) into out."""
        if not slots:
            return
        sel = torch.tensor(slots, device=tokens.device)
        tokens_h, log_probs_h = tokens[sel, :checked].tolist(), log_probs[sel, :checked].tolist()
        end_h, stopped_h = end[sel].tolist(), stopped[sel].tolist()
        for k, slot in enumerate(slots):
            r, n = rows[slot], end_h[k]
            row_ids = tokens_h[k][:n]
            text = self.tokenizer.decode(row_ids, skip_special_tokens=False)
            if slot in scan.hit_rows:   # stop strings disable compaction: slot == original row
                text = _cut_after_stop(text, params.stop)
            out[r] = Generation(row_ids, log_probs_h[k][:n], text, "stop" if stopped_h[k] else "length")


def _cut_after_stop(text: str, stops: list[str]) -> str:
    """Text up to and including the earliest-ending stop string."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text


class _StopStringScan:
    """Finds the first token at which each row's decoded response contains a stop string.

    Token j completes a stop string if it appears in the decoded tail
    tokens[j-M .. j]; M covers the longest stop string even at one character per
    token (plus margin for multi-token characters). Each row's new window is
    first decoded once as a whole; only windows that contain a stop string are
    scanned token by token.
    """

    def __init__(self, tokenizer: Any, stops: list[str], num_rows: int):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.active = bool(stops)
        self.tail = max((len(s) for s in stops), default=0) + 4      # M, in tokens
        self.history: list[list[int]] = [[] for _ in range(num_rows)]  # tokens seen so far per row
        self.hit_rows: set[int] = set()

    def _has_stop(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in self.stops)

    def scan(self, window: list[list[int]], first_step: int, end: list[int], stopped: list[bool]
             ) -> list[tuple[int, int]]:
        """window[r] = tokens of steps first_step.. ; returns (row, new response length) hits."""
        hits = []
        for r, new in enumerate(window):
            hist = self.history[r]
            hist.extend(new)
            if r in self.hit_rows:
                continue
            limit = end[r] if stopped[r] else len(hist)   # never look past an EOS/stop token
            if limit <= first_step:
                continue
            if not self._has_stop(hist[max(0, first_step - self.tail):limit]):
                continue
            for j in range(first_step, limit):
                if self._has_stop(hist[max(0, j + 1 - self.tail):j + 1]):
                    hits.append((r, j + 1))
                    self.hit_rows.add(r)
                    break
        return hits
