"""Next-token sampling: temperature, top-k, top-p (DESIGN.md §6).

`sample_next` draws one token per row and returns its log-prob under
log_softmax(logits / temperature) over the FULL vocabulary — before top-k/top-p
truncation, because that is the distribution the trainer recomputes from its
own logits (DESIGN.md §5), so the two are comparable. Temperature 0 means
greedy; its log-prob is taken at temperature 1.

Draws use the exponential race: argmax_i (p_i / E_i) with E_i ~ Exp(1) i.i.d.
picks i with probability p_i. The noise comes from the caller's torch.Generator,
so a seed fixes the output, and nothing here syncs with the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from furlong.config import Config


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1: off
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)           # stop strings (kept at the end of the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    ignore_eos: bool = False             # benchmarks force response lengths
    seed: int | None = None              # None: a fresh random seed per generate call

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--rollout-temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--rollout-top-p: must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"--rollout-top-k: must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--rollout-max-response-len: must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("--rollout-stop: stop strings must be non-empty")

    @classmethod
    def for_rollout(cls, cfg: "Config", seed: int | None = None) -> "SamplingParams":
        r = cfg.rollout
        return cls(temperature=r.rollout_temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                   max_new_tokens=r.rollout_max_response_len, stop=list(r.rollout_stop),
                   stop_token_ids=list(r.rollout_stop_token_ids), seed=seed)

    @classmethod
    def for_eval(cls, cfg: "Config", seed: int | None = None) -> "SamplingParams":
        """Eval settings, each falling back to the rollout's (config.eval_sampling)."""
        e = cfg.eval_sampling()
        return cls(temperature=e["temperature"], top_p=e["top_p"], top_k=e["top_k"],
                   max_new_tokens=e["max_new_tokens"], stop=list(cfg.rollout.rollout_stop),
                   stop_token_ids=list(cfg.rollout.rollout_stop_token_ids), seed=seed)


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidate logits after top-k/top-p, with -inf for removed entries.

    Returns (logits [B, C], vocab ids [B, C] or None when C is the whole vocab in order).
    """
    ids = None
    if top_k != -1 and top_k < scaled.shape[-1]:
        scaled, ids = torch.topk(scaled, top_k, dim=-1)        # sorted descending
    if top_p < 1.0:
        if ids is None:
            scaled, ids = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(scaled, dim=-1)
        # Drop a token when the mass before it already exceeds top_p (as SGLang);
        # the most likely token always survives.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        scaled = scaled.masked_fill(mass_before > top_p, float("-inf"))
    return scaled, ids


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, log_probs [B] float32 of those tokens)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    full_log_probs = torch.log_softmax(scaled, dim=-1)              # [B, V]
    cand, ids = _truncate(scaled, params.top_k, params.top_p)       # [B, C]
    # Clamp: a zero draw would give -inf + inf = NaN on a removed candidate.
    noise = torch.empty_like(cand).exponential_(generator=generator).clamp_min_(1e-30)
    # argmax(p / E) == argmax(log p - log E); -inf candidates never win.
    pick = torch.argmax(torch.log_softmax(cand, dim=-1) - noise.log(), dim=-1)  # [B]
    tokens = pick if ids is None else ids.gather(-1, pick[:, None]).squeeze(-1)
    return tokens, full_log_probs.gather(-1, tokens[:, None]).squeeze(-1)
