"""Kept groups -> trainer samples: reward shaping, the log-prob passes the estimator needs, advantages.

Order (docs/design.md §5): rewards are shaped first (DAPO's overlong penalty); old
log-probs come from the engine (`--use-rollout-logprobs`), from a separate
trainer forward (when the training forward cannot supply them: several
optimizer steps per rollout, or a KL penalty in the reward that needs them
before training), or later from the training forward itself (one step: exact);
reference log-probs when a KL term needs them; the critic's values (ppo); then
the estimator named by --advantage-estimator, and `--normalize-advantages`
whitening (always on for the reinforce_plus_plus family, which miles requires it
for). Every rank holds the whole batch here, so batch statistics are global
without a collective. With a critic, samples also carry the values and the GAE
returns (unwhitened) that the critic trains on. A multi-turn sample's loss mask (0 on
tool/environment tokens) goes into its TrainSample: the loss weights, token counts, KL and
entropy terms all read it (trainer/batching.py, algorithms/losses.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from furlong.algorithms.advantages import AdvantageInputs, AdvantageParams, get_estimator, whiten
from furlong.algorithms.losses import kl_penalty
from furlong.algorithms.shaping import overlong_penalty
from furlong.types import Group, TrainSample


@dataclass(frozen=True)
class SampleSpec:
    """The algorithm flags that turn kept groups into trainer samples (specs.sample_spec)."""
    advantage_estimator: str         # advantages.get_estimator's name
    use_rollout_logprobs: bool       # old log-probs from the engine
    use_kl_loss: bool                # reference log-probs for the KL loss
    kl_loss_type: str                # estimator of the reward's KL penalty (k1 | k2 | k3 | low_var_kl)
    normalize_advantages: bool       # whiten over the global batch
    overlong_buffer_len: int | None  # DAPO overlong shaping (None: off)
    overlong_penalty_factor: float
    max_response_len: int            # tokens (--rollout-max-response-len)
    advantage: AdvantageParams       # its kl_coef > 0: a KL penalty folded into the token rewards


def shaped_rewards(groups: list[Group], spec: SampleSpec) -> torch.Tensor:
    """[G, n] rewards after DAPO's overlong penalty (when --overlong-buffer-len is set)."""
    max_len = spec.max_response_len
    rows = []
    for g in groups:
        row = []
        for s in g.samples:
            r = float(s.reward)
            if spec.overlong_buffer_len is not None:
                r += overlong_penalty(len(s.response_ids), max_len, spec.overlong_buffer_len,
                                      spec.overlong_penalty_factor)
            row.append(r)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def build_train_samples(groups: list[Group], spec: SampleSpec, actor, critic=None) -> list[TrainSample]:
    """Samples with advantages and the log-probs the loss needs (module docstring); `critic`
    (train/critic.py) is needed by ppo and adds values and returns."""
    samples = [TrainSample(token_ids=torch.tensor(s.prompt.token_ids + s.response_ids, dtype=torch.long),
                           num_prompt_tokens=len(s.prompt.token_ids),
                           advantages=torch.zeros(len(s.response_ids)),
                           rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                           loss_mask=None if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32))
               for g in groups for s in g.samples]
    kl_in_reward = spec.advantage.kl_coef > 0
    if spec.use_rollout_logprobs:
        for s in samples:
            s.old_log_probs = s.rollout_log_probs
    elif kl_in_reward or not actor.reuses_old_log_probs(len(samples)):
        for s, lp in zip(samples, actor.compute_log_probs(samples, which="old")):
            s.old_log_probs = lp
    if spec.use_kl_loss or kl_in_reward:
        for s, lp in zip(samples, actor.compute_log_probs(samples, which="ref")):
            s.ref_log_probs = lp

    # tool/environment tokens (loss mask 0) take no part in whitening, returns or the KL penalty's sums
    masks = [torch.ones(s.num_response_tokens) if s.loss_mask is None else s.loss_mask for s in samples]
    kl = None
    if kl_in_reward:
        kl = [kl_penalty(s.old_log_probs, s.ref_log_probs, spec.kl_loss_type) for s in samples]
    values = critic.compute_values(samples) if critic is not None else None
    inputs = AdvantageInputs(rewards=shaped_rewards(groups, spec), response_masks=masks, kl=kl, values=values)
    advantages, returns = get_estimator(spec.advantage_estimator)(inputs, spec.advantage)
    # miles requires whitening for the reinforce_plus_plus family (its returns are not centred);
    # furlong applies it for them whether or not --normalize-advantages is given.
    if spec.normalize_advantages or spec.advantage_estimator.startswith("reinforce_plus_plus"):
        advantages = whiten(advantages, masks, None)
    for s, adv in zip(samples, advantages):
        s.advantages = adv.float()
    if values is not None:
        for s, v, ret in zip(samples, values, returns):
            s.values, s.returns = v, ret.float()
    return samples
