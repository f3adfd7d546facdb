"""AdamW and the learning-rate schedule (--optimizer, --lr* flags).

Weight decay: applied to weights with >= 2 dims only; biases and norm weights
(1-D) are not decayed, as Megatron does. miles' FSDP backend decays every
parameter; we follow Megatron because decaying RMSNorm gains toward 0 is
never what is wanted.

Schedule (Megatron's OptimizerParamScheduler semantics, which miles' FSDP backend copies), s = optimizer
steps taken so far (LambdaLR's counter; the first update runs at s = 0), D = decay_iters, W = warm-up:
    s <= W                     : init + (lr - init) * s / W       (W > 0; init = --lr-warmup-init)
    constant                   : lr
    s > D                      : min_lr
    inverse-square-root        : max(min_lr, lr * sqrt(max(W, 1) / max(s, 1)))
    otherwise, r = (s - W) / (D - W), lr_s = min_lr + (lr - min_lr) * coeff:
        linear  : coeff = 1 - r
        cosine  : coeff = 0.5 * (1 + cos(pi * r))
        WSD     : coeff = 1 until D - --lr-wsd-decay-iters, then over those last steps, q from 0 to 1, the
                  --lr-wsd-decay-style: exponential 2 * 0.5^q - 1 | linear 1 - q | cosine | minus_sqrt 1 - sqrt(q)
D is --lr-decay-iters (counted from step 0, like Megatron's), by default the run's total optimizer steps,
so decay lasts total - W steps. W is --lr-warmup-fraction * D when given (a float, as Megatron's), else
--lr-warmup-iters.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from furlong.config import OptimConfig


def _param_groups(params_or_model, weight_decay: float) -> list[dict]:
    if isinstance(params_or_model, torch.nn.Module):
        params = [p for p in params_or_model.parameters() if p.requires_grad]
    else:
        params = [p for p in params_or_model if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _on_cuda_run(param: torch.Tensor) -> bool:
    """Whether `param` belongs to a CUDA run: on the GPU, or an FSDP2 shard offloaded to the CPU
    (--fsdp-cpu-offload: its DTensor's mesh is still the GPUs')."""
    mesh = getattr(param, "device_mesh", None)
    return param.device.type == "cuda" or (mesh is not None and mesh.device_type == "cuda")


def _adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    # On a CUDA run the fused kernel: one pass over each tensor instead of foreach's several (it takes
    # FSDP2's sharded DTensors), also for the shards --fsdp-cpu-offload keeps in CPU memory, where
    # torch's default is the per-tensor loop, ~6x slower (67M params: 0.29 s vs 0.048 s on 2 cores),
    # tens of seconds per step at Qwen3-8B. A CPU run keeps torch's default: fused differs from it by
    # float rounding, which over a demo's hundreds of steps is another trajectory, and the CPU demos'
    # documented results are the default's.
    fused = _on_cuda_run(groups[0]["params"][0])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=True if fused else None)


def _offloaded_adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """--optimizer-cpu-offload: the same update as _adamw's (fused on a CUDA run), moments in CPU memory."""
    from furlong.trainer.optimizer_offload import OffloadedAdamW
    return OffloadedAdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                          fused=_on_cuda_run(groups[0]["params"][0]))


# --optimizer name -> constructor. "adam" is AdamW (decoupled decay), as in miles/Megatron.
OPTIMIZERS: dict[str, Callable[[list[dict], OptimConfig], torch.optim.Optimizer]] = {
    "adam": _adamw,
}
# the same names under --optimizer-cpu-offload (optimizer_offload.py)
OFFLOADED_OPTIMIZERS: dict[str, Callable[[list[dict], OptimConfig], torch.optim.Optimizer]] = {
    "adam": _offloaded_adamw,
}


def build_optimizer(params_or_model: torch.nn.Module | Iterable[torch.nn.Parameter],
                    optim_cfg: OptimConfig, offload_moments: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; decay on >= 2-D weights only (see module docstring).
    `offload_moments`: --optimizer-cpu-offload (AdamW's moments in CPU memory, optimizer_offload.py)."""
    table = OFFLOADED_OPTIMIZERS if offload_moments else OPTIMIZERS
    try:
        make = table[optim_cfg.optimizer]
    except KeyError:
        raise ValueError(f"--optimizer: unknown optimizer {optim_cfg.optimizer!r} "
                         f"({', '.join(table)})") from None
    groups = _param_groups(params_or_model, optim_cfg.weight_decay)
    if not groups:
        raise ValueError("build_optimizer: no trainable parameters")
    optimizer = make(groups, optim_cfg)
    init_state(optimizer)
    return optimizer


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state now, exactly as its first step would (AdamW: zero moments, step 0).

    Left lazy, a checkpoint saved before the first step (the actor's during --num-critic-only-steps)
    would create it inside torch's get_state_dict with a zero-lr step that counts as Adam's step 1,
    so the first real update would get step 2's bias correction (about 0.74x its size for betas
    0.9/0.98), and a resumed run would not repeat the uninterrupted one. Here the same zero-lr step
    runs on zero gradients (weights unchanged, moments stay 0) and the step counts are reset to 0.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None
        optimizer.state[p]["step"].zero_()


def _constant(r: float) -> float:
    return 1.0


def _linear(r: float) -> float:
    return 1.0 - r


def _cosine(r: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * r))


# --lr-decay-style -> coefficient in [0, 1] of (lr - min_lr) at decay progress r in [0, 1]. WSD and
# inverse-square-root are not functions of r alone: lr_at_step handles them.
DECAY_STYLES: dict[str, Callable[[float], float] | None] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
    "inverse-square-root": None,
    "WSD": None,
}
# --lr-wsd-decay-style -> coefficient at progress q in [0, 1] of WSD's final decay.
WSD_DECAY_STYLES: dict[str, Callable[[float], float]] = {
    "exponential": lambda q: 2.0 * 0.5 ** q - 1.0,
    "linear": _linear,
    "cosine": _cosine,
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
}


def decay_steps(optim_cfg: OptimConfig, total_steps: int) -> int:
    return total_steps if optim_cfg.lr_decay_iters is None else optim_cfg.lr_decay_iters


def warmup_steps(optim_cfg: OptimConfig, total_steps: int) -> float:
    """W of the module docstring (a float with --lr-warmup-fraction)."""
    c = optim_cfg
    if c.lr_warmup_fraction is not None:
        return c.lr_warmup_fraction * decay_steps(c, total_steps)
    return float(c.lr_warmup_iters)


def lr_at_step(step: int, optim_cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate after `step` optimizer steps (see module docstring)."""
    c = optim_cfg
    if c.lr_decay_style not in DECAY_STYLES:
        raise ValueError(f"--lr-decay-style: unknown style {c.lr_decay_style!r} ({', '.join(DECAY_STYLES)})")
    warmup, decay_iters = warmup_steps(c, total_steps), decay_steps(c, total_steps)
    if warmup > 0 and step <= warmup:
        return c.lr_warmup_init + (c.lr - c.lr_warmup_init) * step / warmup
    if c.lr_decay_style == "constant":
        return c.lr
    if step > decay_iters:
        return c.min_lr
    if c.lr_decay_style == "inverse-square-root":
        return max(c.min_lr, c.lr * math.sqrt(max(warmup, 1.0) / max(step, 1)))
    if c.lr_decay_style == "WSD":
        anneal_start = decay_iters - c.lr_wsd_decay_iters
        coeff = 1.0 if step <= anneal_start else WSD_DECAY_STYLES[c.lr_wsd_decay_style](
            (step - anneal_start) / c.lr_wsd_decay_iters)
    else:
        coeff = DECAY_STYLES[c.lr_decay_style]((step - warmup) / (decay_iters - warmup))
    return c.min_lr + (c.lr - c.min_lr) * coeff


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following lr_at_step; call .step() after each optimizer.step()."""
    c = optim_cfg
    if c.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters: must be >= 0, got {c.lr_warmup_iters}")
    decay_iters, warmup = decay_steps(c, total_steps), warmup_steps(c, total_steps)
    if c.lr_decay_style != "constant" and decay_iters <= warmup:
        raise ValueError(f"--lr-decay-iters: decay must end after warm-up ({decay_iters} <= {warmup:g} warm-up "
                         "steps of --lr-warmup-iters / --lr-warmup-fraction)")
    if c.lr_decay_style == "WSD":
        if c.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style: unknown style {c.lr_wsd_decay_style!r} "
                             f"({', '.join(WSD_DECAY_STYLES)})")
        if c.lr_wsd_decay_iters is None or not 1 <= c.lr_wsd_decay_iters <= decay_iters:
            raise ValueError(f"--lr-wsd-decay-iters: --lr-decay-style WSD needs it in [1, {decay_iters}] (the "
                             f"decay's optimizer steps), got {c.lr_wsd_decay_iters}")
    lr_at_step(0, c, total_steps)  # validates the decay style before training starts
    if c.lr == 0:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at_step(step, c, total_steps) / c.lr)
