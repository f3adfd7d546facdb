"""Advantage estimators (docs/design.md §5), picked by --advantage-estimator from ESTIMATORS.

Every estimator maps (AdvantageInputs, AdvantageConfig) to per-sample token
lists (advantages, returns), each tensor [R_i]. Sample i = g*n + j is sample j of
group g. `r_i` is the scalar reward, `m_t` the loss mask, `kl_t` the per-token KL
estimate (0 when `kl` is None), `c` = --kl-coef. Semantics follow miles
(radixark/miles: loss_hub/advantages.py, math_utils.py, train_data_conversion.py);
verl's differences are noted per estimator.

grpo / gspo: a_i = (r_i - mean_g) / (std_g + 1e-6) (unbiased std; only centered
    when std normalization is off, the group has one sample, or std = 0), put on
    every token of the response, masked or not; returns = advantages. GSPO only
    changes the loss. verl: a group of one gets r_i / (1 + eps) instead of 0, and
    masked tokens get 0.
rloo: a_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g), on every token;
    a group of one gets 0. miles has no RLOO; verl's formula, except that verl
    keeps the raw reward for a group of one and zeroes masked tokens.
reinforce_plus_plus: token rewards x_t = -c kl_t on every response token (KL is
    not masked) plus r_i on the LAST TRAINED token (m_t = 1); returns
    G_t = sum_{k >= t} gamma^(k-t) x_k over the whole response (masked tokens
    included, no reset); advantages = returns. The reward is the raw reward.
    verl instead resets the running return at masked tokens, masks the KL and
    whitens inside the estimator; older slime masks the KL too.
reinforce_plus_plus_baseline: a_t = (r_i - mean_g) - c kl_t on every token, NOT
    discounted (miles broadcasts; there is no gamma here); returns = advantages.
    verl subtracts the group mean of the summed token rewards and whitens inside.
ppo: GAE over the trained tokens only (masked tokens are not transitions: no
    reward, no value, no extra gamma*lambd decay across them). On that
    subsequence x_t = -c kl_t, plus r_i at its last token; V after it is 0;
    delta_t = x_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambd A_{t+1},
    returns = A + V; masked positions get A = returns = 0. verl carries the same
    recursion across masked tokens but writes the carried value there and
    whitens inside the estimator.

Whitening (`whiten`, --normalize-advantages) is a separate step in miles, applied
after any estimator; miles requires it for the reinforce_plus_plus family.
`compute_advantages` is the estimator named by the config, then whitening.
Deviation from miles: a sample with no trained token (miles asserts for
reinforce++) is handled like miles' GAE does it: its reward is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# Added to the std so near-constant groups do not blow up (same constant as miles).
GRPO_STD_EPS = 1e-6
# Added to the variance under the rsqrt in `whiten` (miles' distributed_masked_whiten).
WHITEN_EPS = 1e-8


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages for rewards [G, n] (G groups of n samples); returns [G, n]."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected a [groups, samples] tensor, got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std or rewards.shape[1] < 2:
        return centered
    std = rewards.std(dim=1, unbiased=True, keepdim=True)
    # Zero-std groups keep the plain centered value (all zeros) instead of a division.
    scale = torch.where(std > 0, std + GRPO_STD_EPS, torch.ones_like(std))
    return centered / scale


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor                      # [G, n] float32, one scalar reward per sample
    response_masks: list[torch.Tensor]         # G*n tensors [R_i] float32, 1 = token is trained
    kl: list[torch.Tensor] | None              # G*n tensors [R_i], per-token KL (None: no KL in the reward)
    values: list[torch.Tensor] | None = None   # G*n tensors [R_i], critic values (ppo only)


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"      # ESTIMATORS' name (--advantage-estimator)
    whiten: bool = False         # whiten over the global batch after the estimator (--normalize-advantages;
                                 # config_map turns it on for the reinforce_plus_plus family, as miles requires)
    kl_type: str = "k1"          # estimator of the reward's KL penalty (--kl-loss-type: k1 | k2 | k3 | low_var_kl)
    normalize_std: bool = True   # grpo/gspo: divide by the group std
    normalize_rewards: bool = True   # grpo/gspo/reinforce++-baseline: subtract the group mean (miles'
                                     # --disable-rewards-normalization turns this off: raw rewards)
    kl_coef: float = 0.0         # KL penalty folded into the token rewards (reinforce++ family, ppo)
    gamma: float = 1.0           # discount
    lambd: float = 1.0           # GAE lambda


TokenLists = tuple[list[torch.Tensor], list[torch.Tensor]]  # (advantages, returns), each [R_i]
EstimatorFn = Callable[[AdvantageInputs, AdvantageConfig], TokenLists]


def _checked_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """Flat rewards [G*n] after checking that every per-token list matches the masks."""
    if inputs.rewards.dim() != 2:
        raise ValueError(f"rewards: expected [groups, samples], got shape {tuple(inputs.rewards.shape)}")
    num = inputs.rewards.numel()
    lengths = [m.numel() for m in inputs.response_masks]
    if len(lengths) != num:
        raise ValueError(f"response_masks: {len(lengths)} tensors for {num} rewards")
    for name, tensors in (("kl", inputs.kl), ("values", inputs.values)):
        if tensors is not None and [t.numel() for t in tensors] != lengths:
            raise ValueError(f"{name}: lengths {[t.numel() for t in tensors]} != response lengths {lengths}")
    return inputs.rewards.float().reshape(-1)


def _broadcast(per_sample: torch.Tensor, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's scalar (per_sample [N]) on every token of its response: N tensors [R_i]."""
    return [torch.full((m.numel(),), float(v), dtype=torch.float32, device=m.device)
            for v, m in zip(per_sample.tolist(), masks)]


def _kl_penalty(inputs: AdvantageInputs, params: AdvantageConfig, i: int) -> torch.Tensor:
    """-kl_coef * kl_t for sample i, [R_i] (zeros when there is no KL)."""
    mask = inputs.response_masks[i]
    if inputs.kl is None or params.kl_coef == 0:
        return torch.zeros(mask.numel(), dtype=torch.float32, device=mask.device)
    return -params.kl_coef * inputs.kl[i].float()


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad 1-D tensors with zeros into [B, max_len]."""
    device = rows[0].device if rows else None
    out = torch.zeros(len(rows), max((r.numel() for r in rows), default=0), device=device)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out


def _discounted_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """y_t = x_t + discount * y_{t+1} along dim 1 of x [B, T] (y after the end = 0)."""
    if discount == 1.0:
        return x.flip(1).cumsum(1).flip(1)
    out = torch.zeros_like(x)
    carry = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + discount * carry
        out[:, t] = carry
    return out


def estimate_grpo(inputs: AdvantageInputs, params: AdvantageConfig) -> TokenLists:
    """GRPO (also GSPO): group-normalized reward on every response token; returns = advantages."""
    rewards = _checked_rewards(inputs)                                 # [N]
    if params.normalize_rewards:
        rewards = grpo_advantages(inputs.rewards, params.normalize_std).reshape(-1)
    adv = _broadcast(rewards, inputs.response_masks)
    return adv, adv


def estimate_rloo(inputs: AdvantageInputs, params: AdvantageConfig) -> TokenLists:
    """RLOO: r_i minus the mean of the other rewards of its group (0 for a group of one)."""
    _checked_rewards(inputs)
    rewards = inputs.rewards.float()                                   # [G, n]
    n = rewards.shape[1]
    if n < 2:
        per_sample = torch.zeros_like(rewards)
    else:
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
        per_sample = rewards - others                                  # [G, n]
    adv = _broadcast(per_sample.reshape(-1), inputs.response_masks)
    return adv, adv


def estimate_reinforce_plus_plus(inputs: AdvantageInputs, params: AdvantageConfig) -> TokenLists:
    """REINFORCE++: discounted returns of (KL penalty + reward at the last trained token)."""
    rewards = _checked_rewards(inputs)                                 # [N]
    token_rewards = []
    for i, mask in enumerate(inputs.response_masks):
        x = _kl_penalty(inputs, params, i).clone()                     # [R_i]
        trained = mask.nonzero(as_tuple=True)[0]
        if trained.numel() > 0:
            x[trained[-1]] += rewards[i]
        token_rewards.append(x)
    padded = _discounted_cumsum(_pad(token_rewards), params.gamma)    # [N, max R]
    returns = [padded[i, : x.numel()].clone() for i, x in enumerate(token_rewards)]
    return returns, returns


def estimate_reinforce_plus_plus_baseline(inputs: AdvantageInputs, params: AdvantageConfig) -> TokenLists:
    """REINFORCE++-baseline: (r_i - group mean) on every token minus kl_coef * kl_t; no discounting."""
    centered = _checked_rewards(inputs)                                # [N]
    if params.normalize_rewards:
        centered = grpo_advantages(inputs.rewards, normalize_std=False).reshape(-1)
    adv = [b + _kl_penalty(inputs, params, i)
           for i, b in enumerate(_broadcast(centered, inputs.response_masks))]
    return adv, adv


def estimate_ppo(inputs: AdvantageInputs, params: AdvantageConfig) -> TokenLists:
    """PPO: GAE over each sample's trained tokens; masked tokens get advantage = return = 0."""
    rewards = _checked_rewards(inputs)                                 # [N]
    if inputs.values is None:
        raise ValueError("--advantage-estimator ppo: needs critic values")
    idx = [m.nonzero(as_tuple=True)[0] for m in inputs.response_masks]
    packed_x, packed_v = [], []
    for i, keep in enumerate(idx):
        x = _kl_penalty(inputs, params, i)[keep].clone()               # [K_i]
        if keep.numel() > 0:
            x[-1] += rewards[i]
        packed_x.append(x)
        packed_v.append(inputs.values[i].float()[keep])
    x, v = _pad(packed_x), _pad(packed_v)                              # [N, max K]
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)  # padding and the end bootstrap 0
    adv_packed = _discounted_cumsum(x + params.gamma * next_v - v, params.gamma * params.lambd)
    advantages, returns = [], []
    for i, (keep, mask) in enumerate(zip(idx, inputs.response_masks)):
        a = torch.zeros(mask.numel(), device=mask.device)
        r = torch.zeros(mask.numel(), device=mask.device)
        a[keep] = adv_packed[i, : keep.numel()]
        r[keep] = adv_packed[i, : keep.numel()] + packed_v[i]
        advantages.append(a)
        returns.append(r)
    return advantages, returns


ESTIMATORS: dict[str, EstimatorFn] = {
    "grpo": estimate_grpo,
    "gspo": estimate_grpo,
    "rloo": estimate_rloo,
    "reinforce_plus_plus": estimate_reinforce_plus_plus,
    "reinforce_plus_plus_baseline": estimate_reinforce_plus_plus_baseline,
    "ppo": estimate_ppo,
}


def get_estimator(name: str) -> EstimatorFn:
    """The estimator registered under `name` (the --advantage-estimator value)."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"--advantage-estimator: unknown estimator {name!r} "
                         f"(choices: {', '.join(sorted(ESTIMATORS))})") from None


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor],
           group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """(a - mean) / sqrt(var + 1e-8) with masked statistics over every rank's tokens.

    As miles' distributed_masked_whiten: sum, sum of squares and mask count are
    all-reduced over `group` (None: this process's lists are the whole batch);
    var = E[a^2] - mean^2 with Bessel's n/(n-1) when n >= 2; the mean is not
    added back; every position, masked or not, gets the affine map. Statistics
    are accumulated in float64 (miles: float32) and a negative rounding var is
    clamped to 0. Raises ValueError when the global mask is empty.
    """
    if len(advantages) != len(masks):
        raise ValueError(f"whiten: {len(advantages)} advantage tensors for {len(masks)} masks")
    device = advantages[0].device if advantages else torch.device("cpu")   # an empty rank still all-reduces
    empty = torch.zeros(0, dtype=torch.float64)
    flat = torch.cat([a.reshape(-1) for a in advantages]).double() if advantages else empty
    mask = torch.cat([m.reshape(-1).to(device) for m in masks]).double() if masks else flat.clone()
    if flat.shape != mask.shape:
        raise ValueError(f"whiten: {flat.numel()} advantage tokens for {mask.numel()} mask tokens")
    stats = torch.stack([(flat * mask).sum(), (flat * flat * mask).sum(), mask.sum()])   # [3]
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, total_sq, count = stats.tolist()
    if count == 0:
        raise ValueError("whiten: no trained token in the global batch")
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    if count >= 2:
        var *= count / (count - 1)
    scale = (var + WHITEN_EPS) ** -0.5
    return [((a.double() - mean) * scale).to(a.dtype) for a in advantages]


def compute_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> TokenLists:
    """(advantages, returns) [R_i] per sample: cfg.estimator, then whitening when cfg.whiten. The caller
    holds the whole batch (every rank does), so the statistics are global without a collective; returns
    stay unwhitened (the critic's targets)."""
    advantages, returns = get_estimator(cfg.estimator)(inputs, cfg)
    if cfg.whiten:
        advantages = whiten(advantages, inputs.response_masks, None)
    return [a.float() for a in advantages], [r.float() for r in returns]
