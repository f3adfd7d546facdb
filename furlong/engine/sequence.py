"""Requests in, completions out, and the per-sequence state the scheduler moves around.

A `Request` is one prompt with its own SamplingParams (and so its own
max_new_tokens) and `n` samples. A multi-turn conversation is a chain of
requests: each with `retain_kv` keeps its pages when it finishes, and the
next one (`continues` = its id, prompt = the whole conversation so far)
prefills only the tokens past the cached prefix. The engine prefills the prompt once and forks
it into n `Sequence`s that share the prompt's full KV blocks. A sequence's
tokens are `token_ids` = prompt + generated so far; the KV of every token but
the last is in the cache while it runs (the last one is the next decode input).

A paused sample (partial rollouts, rollout/partial.py) comes back as a request of n = 1 whose
`resume_ids` are its tokens so far: they are prefilled with the prompt but stay its response (their
log-probs, its max_new_tokens budget, stop strings across the pause), and `first_sample` keeps its
sampling noise, so with unchanged weights it continues exactly as if it had never stopped.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from furlong.engine.sampling import SamplingParams, fold_seed


class Status(enum.Enum):
    WAITING = "waiting"     # not in the cache: needs a prefill (new, or preempted)
    RUNNING = "running"     # in the cache, decoding
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]            # [P]
    params: SamplingParams
    n: int = 1                       # samples; they share the prompt's KV
    seed: int = 0                    # sample j draws with seed derived from (seed, j)
    sample_max_new_tokens: list[int] | None = None   # [n] per-sample override (forced-length benches)
    retain_kv: bool = False          # n = 1: its KV pages stay after it finishes, for a `continues` request
    continues: int | None = None     # id of a retained, finished request whose tokens this prompt extends:
                                     # the KV of the common prefix is reused, only the rest is prefilled
    resume_ids: list[int] = field(default_factory=list)         # [k] n = 1: a paused sample's tokens so far
    resume_log_probs: list[float] = field(default_factory=list)  # [k] their engine log-probs
    first_sample: int = 0            # sample j draws the noise of sample first_sample + j of `seed`

    @property
    def num_tokens(self) -> int:
        """Tokens a sample holds when admitted: prompt plus resumed response."""
        return len(self.prompt_ids) + len(self.resume_ids)

    def check(self) -> None:
        """ValueError naming the request where its own fields disagree (the engine's limits: Scheduler.add)."""
        rid = self.request_id
        if self.sample_max_new_tokens is not None and len(self.sample_max_new_tokens) != self.n:
            raise ValueError(f"request {rid}: sample_max_new_tokens needs n={self.n} entries")
        most = max(self.sample_max_new_tokens or [self.params.max_new_tokens])
        if self.resume_ids and (self.n != 1 or len(self.resume_log_probs) != len(self.resume_ids)
                                or len(self.resume_ids) >= most):
            raise ValueError(f"request {rid}: resume_ids need n = 1, a log-prob each and fewer tokens than "
                             f"max_new_tokens")
        if (self.retain_kv or self.continues is not None) and self.n != 1:
            raise ValueError(f"request {rid}: retain_kv and continues need n = 1, got {self.n}")


@dataclass
class Completion:
    """One finished sample of a request."""
    request_id: int
    index: int                       # sample index within the request, 0..n-1
    token_ids: list[int]             # [R] response tokens, including the final EOS/stop token if any
    log_probs: list[float]           # [R] log-prob of each token (sampling temperature, full vocab)
    text: str                        # decoded response, special tokens kept, cut after a stop string
    finish_reason: str               # "stop" | "length" | "abort"


@dataclass
class StepOutput:
    """What one engine step sampled, per row of its plan (model runner -> scheduler)."""
    tokens: list[list[int]]          # [B][window] sampled tokens (window 1 for a prefill)
    log_probs: list[list[float]]     # [B][window]
    num_grouped_rows: int = 0        # rows that read their prompt's KV through a cascade group


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int                               # sample index within the request
    token_ids: list[int]                     # [P + R] prompt then generated tokens
    num_prompt_tokens: int                   # P
    seed32: int                              # folded per-sample seed of the counter-based noise
    log_probs: list[float] = field(default_factory=list)   # [R]
    block_table: list[int] = field(default_factory=list)   # KV pages, in order
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stopped_by_string: bool = False          # its text is cut after the stop string
    num_preemptions: int = 0
    serial: int = -1                         # set at each admission, unique per scheduler: the model runner
                                             # keys its staged buffers on it (object ids are reused)
    num_cached: int = 0                      # leading tokens whose KV its block table already holds (a
                                             # continued conversation): the prefill starts here
    fork_group: int = -1                     # serial of the prefill whose prompt pages it forked (one per
                                             # request, or per shared prompt: scheduler.py); cascade groups on it
    shared_prefix: int = 0                   # leading tokens whose KV is that prefill's, same in every fork
                                             # (later turns keep it, retained.py); 0 once its pages are released

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def max_new_tokens(self) -> int:
        own = self.request.sample_max_new_tokens
        return self.request.params.max_new_tokens if own is None else own[self.index]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def sample_seed32(request_seed: int, index: int) -> int:
    """Per-sample 32-bit noise seed; distinct samples of one request draw independent noise."""
    return fold_seed((request_seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1))


def new_sequences(request: Request) -> list[Sequence]:
    return [Sequence(request=request, index=j, token_ids=list(request.prompt_ids) + list(request.resume_ids),
                     num_prompt_tokens=len(request.prompt_ids), log_probs=list(request.resume_log_probs),
                     seed32=sample_seed32(request.seed, request.first_sample + j),
                     shared_prefix=len(request.prompt_ids))
            for j in range(request.n)]
