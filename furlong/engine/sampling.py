"""Per-request sampling parameters and the reference (CPU) next-token sampler.

Semantics, shared exactly by the GPU kernel (kernels.py):
  * temperature T > 0: log-prob of the chosen token = log_softmax(logits / T)
    over the FULL vocabulary, before any top-k/top-p cut, because that is the
    distribution the trainer recomputes from its own logits; the token is
    argmax_v (logits_v / T - log E_v) over the allowed v, E_v ~ Exp(1) (the
    exponential race: picks v with probability p_v restricted to the allowed set).
  * T == 0: greedy argmax of the logits; its log-prob is taken at T = 1.
  * top-k / top-p become one per-row threshold on the scaled logits (`row_thresholds`):
    v is allowed iff logits_v / T >= threshold. Ties with the threshold value are all
    kept (deviation from a strict top-k; measure-zero for real logits).
  * The noise is counter-based: E_v is a hash of (row seed, position of the token
    being drawn, v), so a sequence's draws never depend on which other sequences
    share its batch, on preemption, or on how the engine windows its steps.
    Seeded runs repeat exactly, and the Triton sampler draws the same E_v.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


MASK32 = 0xFFFFFFFF


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

    @property
    def truncates(self) -> bool:
        """True when top-k/top-p cut the candidate set (the slower, sorting sampler path)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


@dataclass
class SamplingRows:
    """Per-row sampling inputs of one batch, on the logits' device."""
    inv_temperature: torch.Tensor   # [B] float32, 1/T (1.0 for greedy rows, whose log-prob is at T=1)
    greedy: torch.Tensor            # [B] bool
    top_k: torch.Tensor             # [B] int64, vocab size when off
    top_p: torch.Tensor             # [B] float32, 1.0 when off
    seed32: torch.Tensor            # [B] int64 in [0, 2^32): the row's sequence seed, folded to 32 bits
    positions: torch.Tensor         # [B] int64, position of the token being drawn


def fold_seed(seed: int) -> int:
    """A 64-bit (or any) seed folded to 32 bits for the counter-based noise."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply) on int64 values in [0, 2^32).
    Products wrap in int64; the low 32 bits, all that is kept, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_keys(seed32: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 per-row noise key from (seed, position)."""
    return mix32(seed32 ^ mix32((positions + 0x632BE5AB) & MASK32))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 Exp(1) draws: E = -log(u), u = (hash(key, v) >> 8 + 0.5) / 2^24 in (0, 1)."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    h = mix32(keys[:, None] ^ ((v[None, :] * 0x9E3779B9) & MASK32))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(u)


def row_thresholds(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B] float32: the smallest scaled logit each row keeps under its top-k and top-p.

    One descending sort serves both: top-k keeps ranks < k; top-p drops a token once
    the probability mass before it exceeds top_p (as SGLang), so the first token
    always survives. Fixed shapes (no data-dependent sizes): CUDA-graph safe.
    """
    vocab = scaled.shape[-1]
    srt, _ = torch.sort(scaled, dim=-1, descending=True)                # [B, V]
    probs = torch.softmax(srt, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    num_p = (mass_before <= top_p[:, None]).sum(-1).clamp(min=1)        # [B] tokens kept by top-p
    keep = torch.minimum(num_p, top_k.clamp(1, vocab))                  # [B]
    return srt.gather(-1, (keep - 1)[:, None]).squeeze(-1)


def sample_reference(logits: torch.Tensor, rows: SamplingRows, truncate: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, log_probs [B] float32). The exact reference of the
    Triton sampler (module docstring); runs on any device."""
    logits = logits.float()
    scaled = logits * rows.inv_temperature[:, None]
    log_z = torch.logsumexp(scaled, dim=-1)                             # [B]
    # argmax p_v / E_v == argmax (log p_v - log E_v): the exponential race (Gumbel-max with G = -log E)
    score = scaled - torch.log(exponential_noise(row_keys(rows.seed32, rows.positions), logits.shape[-1]))
    if truncate:
        thr = row_thresholds(scaled, rows.top_k, rows.top_p)
        score = score.masked_fill(scaled < thr[:, None], float("-inf"))
    score = torch.where(rows.greedy[:, None], logits, score)
    tokens = torch.argmax(score, dim=-1)
    log_probs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_z
    return tokens, log_probs
