"""AdamW parameter groups and the LR schedule vs a direct formula."""
import math

import pytest
import torch

from furlong.config import OptimConfig
from furlong.trainer.optimizer import build_lr_scheduler, build_optimizer, lr_at_step


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)          # weight decays, bias does not
        self.norm = torch.nn.LayerNorm(4)         # neither decays
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_param_groups_and_hyperparameters():
    cfg = OptimConfig(lr=3e-4, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.98, adam_eps=1e-6)
    m = Tiny()
    opt = build_optimizer(m, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    assert by_decay[0.1] == {id(m.emb.weight), id(m.lin.weight)}
    assert by_decay[0.0] == {id(m.lin.bias), id(m.norm.weight), id(m.norm.bias)}
    g = opt.param_groups[0]
    assert g["lr"] == 3e-4 and g["betas"] == (0.8, 0.98) and g["eps"] == 1e-6
    # An iterable of parameters works too.
    opt2 = build_optimizer(list(m.parameters()), cfg)
    assert sum(len(g["params"]) for g in opt2.param_groups) == 5


def test_decay_step_matches_adamw_formula():
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8)
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0]]))
    b = torch.nn.Parameter(torch.tensor([3.0]))
    opt = build_optimizer([w, b], cfg)
    w.grad, b.grad = torch.tensor([[0.5, 0.5]]), torch.tensor([0.5])
    opt.step()
    # First Adam step moves by lr * sign(g) (bias-corrected m/sqrt(v) = 1); decay only on w.
    torch.testing.assert_close(w.detach(), torch.tensor([[1.0 * (1 - 0.05) - 0.1, -2.0 * (1 - 0.05) - 0.1]]))
    torch.testing.assert_close(b.detach(), torch.tensor([3.0 - 0.1]))


def direct_lr(s, lr, min_lr, style, warmup, decay_iters):
    if warmup > 0 and s <= warmup:
        return lr * s / warmup
    if style == "constant":
        return lr
    if s > decay_iters:
        return min_lr
    r = (s - warmup) / (decay_iters - warmup)
    coeff = {"linear": 1 - r, "cosine": 0.5 * (1 + math.cos(math.pi * r))}[style]
    return min_lr + (lr - min_lr) * coeff


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,decay_iters", [(0, None), (3, None), (2, 7)])
def test_schedule_matches_direct_formula(style, warmup, decay_iters):
    total = 10
    cfg = OptimConfig(lr=2e-3, min_lr=1e-4, lr_decay_style=style, lr_warmup_iters=warmup,
                      lr_decay_iters=decay_iters)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg, total)
    seen = []
    for s in range(total + 3):
        seen.append(opt.param_groups[0]["lr"])
        assert lr_at_step(s, cfg, total) == pytest.approx(seen[-1], rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()
    want = [direct_lr(s, 2e-3, 1e-4, style, warmup, total if decay_iters is None else decay_iters)
            for s in range(total + 3)]
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    if warmup:
        assert seen[0] == 0.0 and seen[warmup] == pytest.approx(2e-3)
    if style != "constant":
        assert seen[-1] == pytest.approx(1e-4)


def test_zero_lr_and_errors():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    cfg = OptimConfig(lr=0.0, lr_decay_style="cosine")
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg, 5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    with pytest.raises(ValueError, match="--optimizer"):
        build_optimizer([p], OptimConfig(optimizer="sgd"))
    with pytest.raises(ValueError, match="--lr-decay-style"):
        build_lr_scheduler(build_optimizer([p], OptimConfig()), OptimConfig(lr_decay_style="step"), 5)
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        build_lr_scheduler(build_optimizer([p], OptimConfig()),
                           OptimConfig(lr_decay_style="linear", lr_warmup_iters=5), 5)
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([frozen], OptimConfig())


def _schedule(cfg: OptimConfig, total: int, steps: int) -> list[float]:
    """The learning rates the optimizer actually runs with, step by step."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg, total)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_warmup_fraction_and_init_lr():
    """--lr-warmup-fraction 0.25 of 8 decay steps = 2 warm-up steps from --lr-warmup-init 1e-3 to --lr 3e-3,
    then linear decay to --min-lr 0 at step 8 (Megatron's formulas, by hand)."""
    cfg = OptimConfig(lr=3e-3, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=5, lr_warmup_fraction=0.25,
                      lr_warmup_init=1e-3)
    want = [1e-3, 2e-3, 3e-3, 2.5e-3, 2e-3, 1.5e-3, 1e-3, 0.5e-3, 0.0, 0.0]
    assert _schedule(cfg, 8, 10) == pytest.approx(want, abs=1e-15)
    # a fractional warm-up (0.3 * 5 = 1.5 steps), as Megatron's float warm-up
    cfg = OptimConfig(lr=2.0, lr_decay_style="constant", lr_warmup_fraction=0.3)
    assert _schedule(cfg, 5, 3) == pytest.approx([0.0, 2.0 / 1.5, 2.0])


@pytest.mark.parametrize("wsd_style,coeffs", [
    ("linear", [1.0, 0.75, 0.5, 0.25, 0.0]),
    ("exponential", [1.0, 2 * 0.5 ** 0.25 - 1, 2 * 0.5 ** 0.5 - 1, 2 * 0.5 ** 0.75 - 1, 0.0]),
    ("cosine", [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]),
    ("minus_sqrt", [1.0, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0]),
])
def test_wsd_schedule(wsd_style, coeffs):
    """WSD over 10 steps with 4 decay steps: constant --lr up to step 6, then the decay style's curve to
    --min-lr at step 10, min_lr after."""
    cfg = OptimConfig(lr=1.0, min_lr=0.1, lr_decay_style="WSD", lr_wsd_decay_style=wsd_style, lr_wsd_decay_iters=4)
    want = [1.0] * 6 + [0.1 + 0.9 * c for c in coeffs] + [0.1]
    assert _schedule(cfg, 10, 12) == pytest.approx(want, abs=1e-12)


def test_inverse_square_root_schedule():
    cfg = OptimConfig(lr=1.0, min_lr=0.3, lr_decay_style="inverse-square-root", lr_warmup_iters=4, lr_decay_iters=20)
    want = [0.0, 0.25, 0.5, 0.75, 1.0, math.sqrt(4 / 5), math.sqrt(4 / 6), math.sqrt(4 / 7), math.sqrt(4 / 8)]
    assert _schedule(cfg, 20, 9) == pytest.approx(want, abs=1e-12)
    assert lr_at_step(40, cfg, 20) == 0.3   # past the decay: min_lr
    assert lr_at_step(19, cfg, 20) == pytest.approx(max(0.3, math.sqrt(4 / 19)))


def test_wsd_needs_its_decay_iters():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    for bad in (None, 0, 11):
        with pytest.raises(ValueError, match="--lr-wsd-decay-iters"):
            build_lr_scheduler(build_optimizer([p], OptimConfig()),
                               OptimConfig(lr_decay_style="WSD", lr_wsd_decay_iters=bad), 10)
    with pytest.raises(ValueError, match="--lr-wsd-decay-style"):
        build_lr_scheduler(build_optimizer([p], OptimConfig()),
                           OptimConfig(lr_decay_style="WSD", lr_wsd_decay_iters=2, lr_wsd_decay_style="step"), 10)


def test_reset_optimizer_state_zeroes_adam():
    """--reset-optimizer-states: Trainer.reset_optimizer_state leaves AdamW as build_optimizer made it."""
    from furlong.trainer.base import Trainer
    p = torch.nn.Parameter(torch.ones(2, 2))
    holder = Trainer.__new__(Trainer)   # only the optimizer is needed
    holder.optimizer = build_optimizer([p], OptimConfig(lr=0.1))
    p.grad = torch.ones(2, 2)
    holder.optimizer.step()
    state = holder.optimizer.state[p]
    assert state["step"] == 1 and state["exp_avg"].abs().sum() > 0
    holder.reset_optimizer_state()
    assert state["step"] == 0 and state["exp_avg"].abs().sum() == 0 and state["exp_avg_sq"].abs().sum() == 0


def test_fused_adamw_on_cuda_runs_including_offloaded_shards():
    """A CUDA run's AdamW is fused, also over --fsdp-cpu-offload's CPU shards (their DTensor mesh is the
    GPUs'); a CPU run keeps torch's default (its demos' documented trajectories)."""
    from types import SimpleNamespace

    from furlong.trainer.optimizer import _on_cuda_run
    cpu_param = torch.nn.Parameter(torch.zeros(2))
    assert not _on_cuda_run(cpu_param)
    offloaded = SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cuda"))
    cpu_mesh = SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cpu"))
    assert _on_cuda_run(offloaded) and not _on_cuda_run(cpu_mesh)
    opt = build_optimizer([cpu_param], OptimConfig(lr=1e-3))
    assert not opt.defaults["fused"]
