"""Typed records the stages of the RL step hand each other (docs/design.md §2).

prompt data ──► Prompt ──rollout──► Sample (grouped in Group) ──stages──►
TrainSample ──packing──► MicroBatch ──loss──► WeightedSums (LossMetrics, ValueLossMetrics)

Shapes use T = packed tokens of a micro-batch, P = prompt tokens, R = response
tokens of one sample, N = samples in a micro-batch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch


@dataclass
class DistContext:
    """Where this process sits among the data-parallel ranks; made by launch/distributed.init_distributed,
    read by the rollout (its share of prompts) and the trainer (its share of samples, its device)."""
    rank: int                 # global rank, 0..world_size-1
    world_size: int           # number of data-parallel processes
    local_rank: int           # rank within this node (selects the GPU)
    device: torch.device      # where this rank's model lives
    backend: str              # "nccl" | "gloo"


@dataclass
class Prompt:
    """One row of a prompt data set, ready for generation."""
    row: int                     # 0-based row index in the source file, before any FILE@[a:b] slicing
    raw: Any                     # the input-key value: chat messages (list of dicts) or a string
    text: str                    # prompt text after the chat template (if any)
    token_ids: list[int]         # [P]
    label: str                   # the label-key value as a string ("" when absent)
    metadata: dict[str, Any] = field(default_factory=dict)   # the --metadata-key value; "tools": the --tool-key value


class SampleStatus(enum.Enum):
    """miles' Sample.Status over furlong's finish_reason strings (the value IS the finish_reason)."""
    PENDING = "pending"          # handed to a custom generate function, not finished yet
    COMPLETED = "stop"           # EOS or stop string
    TRUNCATED = "length"         # hit the response or context limit
    ABORTED = "abort"
    FAILED = "failed"            # a recoverable failure inside a custom generate function (tool error, ...)


@dataclass
class Sample:
    """One generated response to a prompt. A multi-turn response holds the model's turns and the
    tool/environment tokens between them, in order; `loss_mask` tells them apart. The properties
    `tokens`, `response_length`, `response`, `label` and `status` are miles' names for these fields."""
    prompt: Prompt
    group_id: int                # which group (prompt occurrence) within the rollout
    index: int                   # position within its group, 0..n-1
    response_ids: list[int]      # [R] response tokens (model and tool tokens), incl. a final EOS/stop token
    response_text: str           # decoded response (special tokens kept)
    rollout_log_probs: list[float]  # [R] engine log-probs of the sampled tokens (after temperature); 0.0 on tool tokens
    finish_reason: str           # a SampleStatus value: "stop" | "length" | "abort" | "failed" | "pending"
    reward: float | None = None  # None until rewarded (a custom generate function may set it)
    loss_mask: list[int] | None = None       # [R] 1 = model token (trains), 0 = tool/environment token; None: all 1
    metadata: dict[str, Any] = field(default_factory=dict)   # free-form, per sample (starts as the prompt's)

    Status: ClassVar[type[SampleStatus]] = SampleStatus

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.token_ids) + len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        """[P+R] prompt then response tokens (miles' `tokens`; read-only: set response_ids)."""
        return self.prompt.token_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def response(self) -> str:
        return self.response_text

    @response.setter
    def response(self, text: str) -> None:
        self.response_text = text

    @property
    def label(self) -> str:
        return self.prompt.label

    @property
    def status(self) -> SampleStatus:
        return SampleStatus(self.finish_reason)

    @status.setter
    def status(self, value: SampleStatus) -> None:
        self.finish_reason = SampleStatus(value).value

    @property
    def num_trained_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        """Model turns: runs of trained tokens in the response (1 without a loss mask)."""
        if self.loss_mask is None:
            return 1
        return sum(1 for j, m in enumerate(self.loss_mask) if m and (j == 0 or not self.loss_mask[j - 1]))

    def add_model_tokens(self, token_ids: list[int], log_probs: list[float], text: str) -> None:
        """Append a model turn's tokens [k] with their engine log-probs [k] (trained: mask 1)."""
        self._add(token_ids, list(log_probs), text, 1)

    def add_tool_tokens(self, token_ids: list[int], text: str) -> None:
        """Append tool/environment tokens [k] (in the context, out of the loss: mask 0, log-prob 0.0)."""
        self._add(token_ids, [0.0] * len(token_ids), text, 0)

    def _add(self, token_ids: list[int], log_probs: list[float], text: str, mask: int) -> None:
        if len(log_probs) != len(token_ids):
            raise ValueError(f"sample (group {self.group_id}, index {self.index}): {len(token_ids)} tokens, "
                             f"{len(log_probs)} log-probs")
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        self.response_ids = self.response_ids + list(token_ids)
        self.rollout_log_probs = self.rollout_log_probs + log_probs
        self.loss_mask = self.loss_mask + [mask] * len(token_ids)
        self.response_text += text

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Group:
    """The n samples of one prompt; GRPO normalizes rewards within it."""
    group_id: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class TrainSample:
    """A sample in trainer form. Per-response-token fields have length R."""
    token_ids: torch.Tensor          # [P+R] int64, prompt then response
    num_prompt_tokens: int           # P
    advantages: torch.Tensor         # [R] float32 (GRPO: the sample's advantage repeated)
    rollout_log_probs: torch.Tensor  # [R] float32, from the engine
    old_log_probs: torch.Tensor | None = None   # [R] float32, policy before the step (None: reuse)
    ref_log_probs: torch.Tensor | None = None   # [R] float32, reference model (KL loss only)
    loss_mask: torch.Tensor | None = None       # [R] float32, 1 = token trains (None: all ones)
    values: torch.Tensor | None = None          # [R] float32, critic values before the step (ppo only)
    returns: torch.Tensor | None = None         # [R] float32, GAE returns: the critic's targets (ppo only)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.token_ids.numel()) - self.num_prompt_tokens


@dataclass
class MicroBatch:
    """Samples packed into one row. Position t's hidden state predicts targets[t].

    All per-position tensors are [T] and aligned: targets[t] = token t+1 of the
    same sample (0 at a sample's last position), and loss_weight[t] = 0 wherever
    targets[t] is not a trained response token. A rank with fewer micro-batches than
    the others pads up to the common count with a 1-token, zero-weight dummy
    (batching.padding_micro_batch), which contributes nothing.
    """
    input_ids: torch.Tensor       # [T] int64
    position_ids: torch.Tensor    # [T] int64, restarting at 0 per sample
    cu_seqlens: torch.Tensor      # [N+1] int32, sample boundaries in the packed row
    max_seqlen: int               # longest sample in the row
    targets: torch.Tensor         # [T] int64
    loss_weight: torch.Tensor     # [T] float32, aggregation weight of each token's loss (0 = no loss)
    response_mask: torch.Tensor   # [T] float32, 1 where targets[t] is a trained response token
    advantages: torch.Tensor      # [T] float32
    old_log_probs: torch.Tensor | None     # [T] float32 (None: reuse the training forward's)
    rollout_log_probs: torch.Tensor        # [T] float32
    ref_log_probs: torch.Tensor | None     # [T] float32
    sample_indices: list[int] = field(default_factory=list)  # indices into the step's TrainSample list
    # [T] float32: the plain-mean weights of the KL and entropy terms and of every metric, when the policy
    # term's reducer differs (Dr.GRPO's constant normalizer, as miles' reducer changes only that term);
    # None: loss_weight is the mean too
    metric_weight: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class WeightedSums:
    """Base of a loss's metrics (losses.LossMetrics, value_loss.ValueLossMetrics): weighted sums
    (sum(x * loss_weight)) of one micro-batch, each a 0-d float32 tensor on the loss's device (no host
    sync). Added over a step's micro-batches and ranks they give the step's aggregate; `stacked` makes
    them one tensor for one all-reduce and one host copy, `from_host` the record again."""

    def __add__(self, other: WeightedSums) -> WeightedSums:
        return type(self)(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def stacked(self) -> torch.Tensor:
        """[K], the fields in declaration order."""
        return torch.stack([getattr(self, f.name) for f in fields(self)])

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu") -> WeightedSums:
        return cls(*(torch.zeros((), device=device) for _ in fields(cls)))

    @classmethod
    def from_host(cls, values: list[float]) -> WeightedSums:
        """The record of `stacked()`'s values after the host copy (0-d CPU tensors)."""
        return cls(*(torch.tensor(v) for v in values))
