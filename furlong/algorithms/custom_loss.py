"""User functions inside the actor's loss, with miles' call signatures on furlong's packed micro-batches.

    --loss-type custom_loss --custom-loss-function-path M.f   the whole objective (the "custom" loss of
        trainer/actor.LOSSES): f(args, batch, log_probs, entropy, sum_of_sample_mean) -> (loss, metrics)
    --custom-tis-function-path M.f    (with --use-tis) replaces the TIS weights inside losses.rl_loss:
        f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
          parallel_state=None, max_seq_lens=None) -> (pg_loss, loss_masks, metrics)
    --custom-pg-loss-reducer-function-path M.f   the policy term's aggregation inside losses.rl_loss:
        f(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(pg) -> scalar

What they get, against miles: `args` is user_code.miles_args (every flag by dest name). Per-sample values
are lists over the micro-batch's samples of their response tokens ([R_i] each), as miles' are, and a flat
"pg" is their concatenation [R]; `batch` is LossBatch (miles' key names, also readable as batch["key"]).
Deviations: a custom loss gets the sampled tokens' log-probs [R_i] (with grad) and entropies instead of
the logits (furlong never holds the whole [T, V] logits: trainer/logprobs.py chunks them), and
`sum_of_sample_mean(x [R])` is furlong's aggregation, sum(x * loss weight), whose sum over micro-batches
and ranks is the step's objective (miles' reducer plus its division by the global batch); its metrics must
be such sums and be named like losses.LossMetrics' fields (miles' "entropy_loss" is "entropy"). A TIS
function's masks multiply the policy, KL and entropy terms (miles rebuilds its reducer from them, the
denominators unchanged); its metrics are checked, not logged (LossMetrics is a fixed set). A pg reducer
runs per micro-batch like miles'; its value is scaled by the step's normalizer (1 / global batch, or
1 / the step's loss tokens with --calculate-per-token-loss), so the default reducer reproduces furlong's
own loss. Wrong return types or shapes, and exceptions, stop the run with one line naming the function.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from furlong.types import MicroBatch
from furlong.user_code import UserCodeError, call_user

LOSS_FLAG = "--custom-loss-function-path"
TIS_FLAG = "--custom-tis-function-path"
REDUCER_FLAG = "--custom-pg-loss-reducer-function-path"
Slices = list[tuple[int, int]]   # (start, end) of each packed sample's response positions in the micro-batch


@dataclass(frozen=True)
class UserLossFunctions:
    """The loaded functions (None: not given) and what they are told (config_map.loss_config)."""
    args: Any                               # user_code.miles_args of the run
    loss: Callable[..., Any] | None = None
    loss_name: str = ""
    tis: Callable[..., Any] | None = None
    tis_name: str = ""
    pg_reducer: Callable[..., Any] | None = None
    pg_reducer_name: str = ""
    calculate_per_token_loss: bool = False


@dataclass
class LossBatch:
    """A micro-batch as miles' loss functions read it: one entry per packed sample."""
    advantages: list[torch.Tensor]                  # [R_i]
    log_probs: list[torch.Tensor]                   # [R_i] old policy (the training forward's, detached, when reused)
    ref_log_probs: list[torch.Tensor] | None        # [R_i] (None without a reference model)
    rollout_log_probs: list[torch.Tensor]           # [R_i] the engine's
    loss_masks: list[torch.Tensor]                  # [R_i] float, 1 = the token trains
    response_lengths: list[int]
    total_lengths: list[int]                        # prompt + response tokens
    unconcat_tokens: list[torch.Tensor]             # [P_i + R_i] token ids

    def __getitem__(self, key: str) -> Any:         # miles' batch["advantages"]
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _split(x: torch.Tensor, slices: Slices) -> list[torch.Tensor]:
    return [x[s:e] for s, e in slices]


def _positions(slices: Slices, device: torch.device) -> torch.Tensor:
    if not slices:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(s, e, dtype=torch.long, device=device) for s, e in slices])


def _total_lengths(mb: MicroBatch, slices: Slices) -> list[int]:
    cu = mb.cu_seqlens.tolist()   # [N+1] ints, a few per micro-batch (host copy of a small tensor)
    return [cu[k + 1] - cu[k] for k in range(len(slices))]


def _check_tensor(x: Any, shape: tuple[int, ...], what: str, flag: str, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise UserCodeError(f"{flag}: {name} returned {what} of shape {got}, expected a tensor of shape {shape}")
    return x


def user_tis(fns: UserLossFunctions, mb: MicroBatch, slices: Slices, pg: torch.Tensor, old: torch.Tensor,
             rollout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg [T] with the function's pg on the response positions, mask [T]: its loss masks there, 1 elsewhere)."""
    resp = _positions(slices, pg.device)
    masks = _split(mb.response_mask, slices)
    lengths = [e - s for s, e in slices]
    out = call_user(fns.tis, fns.tis_name, TIS_FLAG, fns.args, pg_loss=pg[resp], train_log_probs=_split(old.detach(), slices),
                    rollout_log_probs=_split(rollout, slices), loss_masks=masks,
                    total_lengths=_total_lengths(mb, slices), response_lengths=lengths, parallel_state=None,
                    max_seq_lens=None)
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)
            and isinstance(out[1], (list, tuple)) and len(out[1]) == len(slices)):
        raise UserCodeError(f"{TIS_FLAG}: {fns.tis_name} must return (pg_loss, loss_masks: a list of "
                            f"{len(slices)} tensors, metrics: dict), got {type(out).__name__}")
    new_pg = _check_tensor(out[0], (len(resp),), "pg_loss", TIS_FLAG, fns.tis_name)
    new_masks = [_check_tensor(m, (n,), "a loss mask", TIS_FLAG, fns.tis_name).to(pg.dtype)
                 for m, n in zip(out[1], lengths)]
    mask = torch.ones_like(pg)
    if slices:
        mask = mask.index_copy(0, resp, torch.cat(new_masks))
        pg = pg.index_copy(0, resp, new_pg.to(pg.dtype))
    return pg, mask


def user_pg_term(fns: UserLossFunctions, mb: MicroBatch, slices: Slices, pg: torch.Tensor, tis_mask: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The policy term of the micro-batch under the user's reducer, scaled by the step's normalizer (module
    docstring). weights [T]: the plain aggregation weights (seq-mean-token-mean or per-token)."""
    if not slices:   # a padding micro-batch: nothing to reduce, but keep the graph
        return (pg * 0.0).sum()
    lengths = [e - s for s, e in slices]
    masks = _split(mb.response_mask * tis_mask, slices)
    reducer = call_user(fns.pg_reducer, fns.pg_reducer_name, REDUCER_FLAG, _total_lengths(mb, slices), lengths,
                        masks, fns.calculate_per_token_loss)
    if not callable(reducer):
        raise UserCodeError(f"{REDUCER_FLAG}: {fns.pg_reducer_name} must return a reducer function, got "
                            f"{type(reducer).__name__}")
    value = call_user(reducer, f"the reducer of {fns.pg_reducer_name}", REDUCER_FLAG,
                      pg[_positions(slices, pg.device)])
    value = _check_tensor(value, (), "a reduced pg_loss", REDUCER_FLAG, fns.pg_reducer_name)
    # the default reducer of ones (trained tokens, or samples with one) against the weights' sum: the normalizer
    base = _split(mb.response_mask, slices)
    ones = (torch.stack([m.sum() for m in base]).sum() if fns.calculate_per_token_loss
            else torch.stack([(m.sum() > 0).to(m.dtype) for m in base]).sum())
    return value * (weights.sum() / ones.clamp(min=1))


def custom_loss(mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor | None, params: Any,
                slices: Slices) -> tuple[torch.Tensor, Any]:
    """--loss-type custom_loss: the user's objective and its metrics (a losses.LossMetrics)."""
    from furlong.algorithms.losses import LossMetrics
    fns: UserLossFunctions = params.user
    metrics = LossMetrics.zeros(log_probs.device)
    if not slices:
        return (log_probs * 0.0).sum(), metrics
    cur = log_probs.detach()
    old = cur if mb.old_log_probs is None else mb.old_log_probs
    batch = LossBatch(advantages=_split(mb.advantages, slices), log_probs=_split(old, slices),
                      ref_log_probs=None if mb.ref_log_probs is None else _split(mb.ref_log_probs, slices),
                      rollout_log_probs=_split(mb.rollout_log_probs, slices),
                      loss_masks=_split(mb.response_mask, slices), response_lengths=[e - s for s, e in slices],
                      total_lengths=_total_lengths(mb, slices),
                      unconcat_tokens=[mb.input_ids[int(a):int(b)] for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])])
    w = mb.loss_weight[_positions(slices, log_probs.device)]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * w).sum()

    out = call_user(fns.loss, fns.loss_name, LOSS_FLAG, fns.args, batch, _split(log_probs, slices),
                    None if entropy is None else _split(entropy, slices), sum_of_sample_mean)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise UserCodeError(f"{LOSS_FLAG}: {fns.loss_name} must return (loss, metrics: dict), got {type(out).__name__}")
    loss = _check_tensor(out[0], (), "a loss", LOSS_FLAG, fns.loss_name)
    names = {f.name for f in dataclasses.fields(LossMetrics)}
    for key, value in out[1].items():
        field = "entropy" if key == "entropy_loss" else key
        if field not in names:
            raise UserCodeError(f"{LOSS_FLAG}: {fns.loss_name} returned metric {key!r}; furlong logs "
                                f"{', '.join(sorted(names))}")
        setattr(metrics, field, _check_tensor(torch.as_tensor(value, device=log_probs.device), (), f"metric {key!r}",
                                              LOSS_FLAG, fns.loss_name).detach().float())
    metrics.loss = loss.detach().float()
    # a loss built without the log-probs still gets a graph to run backward on (miles adds 0 * logits too)
    return loss + 0.0 * log_probs.sum(), metrics
