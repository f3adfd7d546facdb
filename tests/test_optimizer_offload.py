"""--optimizer-cpu-offload (trainer/optimizer_offload.py): AdamW's moments in CPU memory, streamed through
device buckets for each update. On the CPU the "device" is the CPU and the copies are plain copies, so
these tests check the bucketing, the per-parameter step counts, the state's layout and its checkpoints,
not the CUDA streams (which only the device runs exercise). Every comparison is exact: the update is the
same functional AdamW torch.optim.AdamW runs, elementwise, on slices."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401

from furlong.config import OptimConfig  # noqa: E402
from furlong.config_map import actor_config  # noqa: E402
from furlong.launch.distributed import init_distributed, launch_local  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.trainer.optimizer import build_lr_scheduler, build_optimizer  # noqa: E402
from furlong.trainer.optimizer_offload import OffloadedAdamW, plan_buckets  # noqa: E402

LENGTHS = [20, 12, 10, 9, 8, 7]
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.98, lr_decay_style="cosine",
                    lr_warmup_iters=1)


# ------------------------------------------------------------------ one process, no sharding

def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    """n optimizer steps of a fixed loss under OPTIM's schedule (warm-up, then cosine decay)."""
    sched = build_lr_scheduler(opt, OPTIM, 4)
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        ids = torch.randint(0, 64, (1, 9), generator=g)
        model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def _offloaded(model: torch.nn.Module, bucket_bytes: int) -> OffloadedAdamW:
    groups = build_optimizer(model, OPTIM).param_groups   # the groups build_optimizer makes: decay on >= 2-D only
    return OffloadedAdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=OPTIM.lr,
                          betas=(OPTIM.adam_beta1, OPTIM.adam_beta2), eps=OPTIM.adam_eps, fused=False,
                          bucket_bytes=bucket_bytes)


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    return load_pretrained(str(tiny_ckpt)).float()


def test_build_optimizer_places_moments_in_cpu_buffers(tiny_model):
    opt = build_optimizer(copy.deepcopy(tiny_model), OPTIM, offload_moments=True)
    assert isinstance(opt, OffloadedAdamW) and not opt.fused
    assert {g["weight_decay"] for g in opt.param_groups} == {0.1, 0.0}
    for p, st in opt.state.items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["step"].item() == 0
        for k in ("exp_avg", "exp_avg_sq"):   # a view of the flat host buffer, shaped like the parameter
            assert st[k].shape == p.shape and st[k].untyped_storage().data_ptr() == opt.host[k].data_ptr()


@pytest.mark.parametrize("bucket_bytes", [8 * 5, 8 * 3000, 256 * 1024 ** 2],
                         ids=["smaller-than-a-param", "several-params", "default"])
def test_equals_adamw_with_decay_groups_and_schedule(tiny_model, bucket_bytes):
    ref_model, off_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    ref = build_optimizer(ref_model, OPTIM)
    off = _offloaded(off_model, bucket_bytes)
    numels = [p.numel() for g in off.param_groups for p in g["params"]]
    if bucket_bytes == 8 * 5:
        assert all(b.stop - b.start <= 5 for b in off.buckets) and len(off.buckets) > len(numels)
    elif bucket_bytes == 8 * 3000:
        assert any(len({c.index for c in b.chunks}) > 1 for b in off.buckets)
    _steps(ref_model, ref)
    _steps(off_model, off)
    start = dict(tiny_model.named_parameters())
    moved = max((p - start[n]).abs().max().item() for n, p in ref_model.named_parameters())
    assert moved > 1e-3
    for (n, a), b in zip(ref_model.named_parameters(), off_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    off_params = [p for g in off.param_groups for p in g["params"]]
    for a, b in zip(ref_params, off_params):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(off.state[b][k], ref.state[a][k], rtol=0, atol=0)


def test_load_state_dict_copies_moments_into_the_cpu_buffers(tiny_model):
    """An AdamW state dict (copied, as one read from a file) loads into the offloaded optimizer: the
    moments land in its flat buffers and the next step equals AdamW's."""
    ref_model, off_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    ref = build_optimizer(ref_model, OPTIM)
    _steps(ref_model, ref, 2)
    off_model.load_state_dict(ref_model.state_dict())
    off = _offloaded(off_model, 8 * 3000)
    off.load_state_dict(copy.deepcopy(ref.state_dict()))
    for st in off.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].untyped_storage().data_ptr() == off.host[k].data_ptr()
    assert off.host["exp_avg_sq"].abs().sum() > 0
    for model, opt in ((ref_model, ref), (off_model, off)):
        model(torch.arange(9).reshape(1, 9)).float().pow(2).mean().backward()
        opt.step()
    for (n, a), b in zip(ref_model.named_parameters(), off_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


def test_plan_buckets_covers_every_element_once():
    numels = [7, 1, 20, 3, 0, 5]
    for size in (1, 4, 7, 8, 100):
        buckets = plan_buckets(numels, size)
        seen = [[0] * n for n in numels]
        pos = 0
        for b in buckets:
            assert b.start == pos and 0 < b.stop - b.start <= size
            pos = b.stop
            offset = 0
            for c in b.chunks:
                assert c.offset == offset and c.stop > c.start
                offset += c.stop - c.start
                for e in range(c.start, c.stop):
                    seen[c.index][e] += 1
            assert offset == b.stop - b.start
        assert pos == sum(numels) and all(x == 1 for s in seen for x in s)


def test_parameter_without_gradient_is_left_as_adamw_leaves_it():
    a, b = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))
    opt = OffloadedAdamW([a, b], lr=0.1, betas=(0.9, 0.99), eps=1e-8, fused=False, bucket_bytes=8 * 4)
    a.grad = torch.full_like(a, 0.5)
    opt.step()
    assert opt.state[a]["step"].item() == 1 and opt.state[b]["step"].item() == 0
    assert torch.equal(b.detach(), torch.ones(5)) and not opt.state[b]["exp_avg"].any()
    torch.testing.assert_close(a.detach(), torch.full((4, 3), 0.9))   # first Adam step: lr * sign(g)


# ------------------------------------------------------------------ FSDP2 actors: 1 and 2 gloo ranks

def _actor(ckpt: str, offload: bool) -> Actor:
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3, clip_grad=1.0,
                      weight_decay=0.1, optimizer_cpu_offload=offload)
    actor = Actor(load_pretrained(ckpt), actor_config(cfg), init_distributed("cpu"))
    assert isinstance(actor.optimizer, OffloadedAdamW) == offload
    return actor


def two_steps(ckpt: str, offload: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    actor = _actor(ckpt, offload)
    m = train_rollout(actor, tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3),
                      synthetic_samples(LENGTHS))
    assert m.num_steps == 2
    if offload:   # the moments are DTensors sharded like their parameters, local shards in the CPU buffers
        for p in actor.model.parameters():
            st = actor.optimizer.state[p]
            assert st["exp_avg"].placements == p.placements and st["exp_avg"].shape == p.shape
            assert st["exp_avg"].to_local().shape == p.to_local().shape
            assert st["exp_avg_sq"].to_local().device.type == "cpu"
    return full_weights(actor), m.to_log()


def _two_rank_worker(ckpt: str, out: str) -> None:
    res = {flag: two_steps(ckpt, flag)[0] for flag in (False, True)}
    if torch.distributed.get_rank() == 0:
        torch.save(res, out)


def test_offloaded_actor_equals_adamw_actor_one_process(tiny_ckpt):
    (normal, _), (offloaded, log) = two_steps(str(tiny_ckpt), False), two_steps(str(tiny_ckpt), True)
    for n, w in normal.items():
        torch.testing.assert_close(offloaded[n], w, rtol=0, atol=0, msg=n)
    assert log["perf/optimizer_step_time"] > 0 and "train/optimizer_step_seconds" not in log


def test_offloaded_actor_equals_adamw_actor_two_ranks(tiny_ckpt, tmp_path):
    out = tmp_path / "res.pt"
    launch_local(_two_rank_worker, 2, str(tiny_ckpt), str(out))
    res = torch.load(out, weights_only=False)
    for n, w in res[False].items():
        torch.testing.assert_close(res[True][n], w, rtol=0, atol=0, msg=n)


# ------------------------------------------------------------------ checkpoints (DCP, as runs save them)

def _resume_worker(ckpt: str, save_dir: str, out: str) -> None:
    """Train 2 rollouts, save, train a 3rd; then resume from the save into an offloaded and a resident
    actor and train the same 3rd rollout: all three end with the same weights."""
    from test_checkpoint import _config, rollout_samples
    from furlong.checkpoint.store import load_checkpoint, save_checkpoint
    ctx = init_distributed("cpu")

    def make(offload: bool) -> Actor:
        cfg = _config(ckpt)
        cfg.parallel.optimizer_cpu_offload = offload
        return Actor(load_pretrained(ckpt), actor_config(cfg), ctx)

    def train(actor: Actor, rollout_id: int) -> None:
        train_rollout(actor, _config("unused"), rollout_samples(rollout_id))

    a = make(True)
    train(a, 0)
    train(a, 1)
    save_checkpoint(save_dir, a, rollout_id=1)
    train(a, 2)
    res = {"uninterrupted": full_weights(a)}
    for name, offload in (("offloaded", True), ("resident", False)):
        b = make(offload)
        load_checkpoint(save_dir, b)
        if offload:   # loaded into the pinned buffers, not onto the parameters' device
            opt = b.optimizer
            for st in opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    local = st[k].to_local()
                    base = opt.host[k].data_ptr()
                    assert base <= local.data_ptr() < base + opt.host[k].numel() * 4 or local.numel() == 0
            assert any(st["exp_avg"].to_local().abs().sum() > 0 for st in opt.state.values())
            assert all(st["step"].item() == 4 for st in opt.state.values())   # 2 rollouts x 2 optimizer steps
        train(b, 2)
        res[name] = full_weights(b)
    if torch.distributed.get_rank() == 0:
        torch.save(res, out)


@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_from_checkpoint_is_exact(tiny_ckpt, tmp_path, ranks):
    out = tmp_path / "res.pt"
    if ranks == 1:
        _resume_worker(str(tiny_ckpt), str(tmp_path / "save"), str(out))
    else:
        launch_local(_resume_worker, 2, str(tiny_ckpt), str(tmp_path / "save"), str(out))
    res = torch.load(out, weights_only=False)
    for n, w in res["uninterrupted"].items():
        for name in ("offloaded", "resident"):
            torch.testing.assert_close(res[name][n], w, rtol=0, atol=0, msg=f"{name} {n}")


def test_reset_optimizer_states_zeroes_the_cpu_moments(tiny_ckpt):
    actor = _actor(str(tiny_ckpt), True)
    train_rollout(actor, tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3),
                  synthetic_samples(LENGTHS))
    assert actor.optimizer.host["exp_avg"].abs().sum() > 0
    actor.reset_optimizer_state()
    assert not actor.optimizer.host["exp_avg"].any() and not actor.optimizer.host["exp_avg_sq"].any()
    assert all(st["step"].item() == 0 for st in actor.optimizer.state.values())
