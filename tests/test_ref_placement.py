"""--ref-placement: the KL reference in CPU memory between passes gives the same reference log-probs and
the same training as a resident one (1 process and 2 gloo ranks), follows the actor under
--ref-update-interval, and `auto` picks the CPU only where a resident copy would cost real GPU memory.
On the CPU the offload policy places nothing elsewhere, so this checks the arithmetic and the plumbing
(the offloaded reference's FSDP groups, its gathered-once pass); the copy cost is the device bench's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401

from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.launch.distributed import init_distributed, launch_local  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.run.reference import ref_on_cpu  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402

LENGTHS = [20, 12, 10, 9, 8, 7]
GIB = 2**30


def _kl_config(placement: str):
    return tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3, use_kl_loss=True,
                       kl_loss_coef=0.5, ref_placement=placement)


def _offloaded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy
    group = model.layers[0]._get_fsdp_state()._fsdp_param_group
    return isinstance(group.offload_policy, CPUOffloadPolicy)


def run(ckpt: str, placement: str) -> dict[str, object]:
    """Reference log-probs before training, the actor after two KL-loss optimizer steps, and the reference
    log-probs after --ref-update-interval's copy of the actor into the reference."""
    cfg = _kl_config(placement)
    actor = Actor(load_pretrained(ckpt), actor_config(cfg), init_distributed("cpu"))
    assert _offloaded(actor.ref_model) == (placement == "cpu") and not _offloaded(actor.model)
    samples = synthetic_samples(LENGTHS)
    ref_before = actor.compute_log_probs(samples, batching_config(cfg), "ref")
    m = train_rollout(actor, cfg, samples)
    assert m.num_steps == 2
    actor.update_reference()
    return {"ref_before": ref_before, "weights": full_weights(actor),
            "ref_after": actor.compute_log_probs(samples, batching_config(cfg), "ref"),
            "old_after": actor.compute_log_probs(samples, batching_config(cfg), "old")}


def _same(a: dict[str, object], b: dict[str, object], rtol: float = 0.0, atol: float = 0.0) -> None:
    for key in ("ref_before", "ref_after", "old_after"):
        for x, y in zip(a[key], b[key]):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=key)
    for n, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][n], w, rtol=rtol, atol=atol, msg=n)


def test_reference_on_cpu_equals_resident_one_process(tiny_ckpt):
    gpu, cpu = run(str(tiny_ckpt), "gpu"), run(str(tiny_ckpt), "cpu")
    _same(gpu, cpu)
    start = {n: p.float() for n, p in load_pretrained(str(tiny_ckpt)).state_dict().items()}
    assert max((gpu["weights"][n] - start[n]).abs().max().item() for n in start) > 1e-4   # the steps trained
    # the update made the reference the trained actor (bf16-free on the CPU: the same numbers as "old")
    for r, o, b in zip(cpu["ref_after"], cpu["old_after"], cpu["ref_before"]):
        torch.testing.assert_close(r, o)
        assert not torch.equal(r, b)


def _worker(ckpt: str, out: str) -> None:
    res = {p: run(ckpt, p) for p in ("gpu", "cpu")}
    if torch.distributed.get_rank() == 0:
        torch.save(res, out)


def test_reference_on_cpu_equals_resident_two_ranks(tiny_ckpt, tmp_path):
    out = tmp_path / "res.pt"
    launch_local(_worker, 2, str(tiny_ckpt), str(out))
    res = torch.load(out, weights_only=False)
    _same(res["gpu"], res["cpu"])
    _same(run(str(tiny_ckpt), "cpu"), res["cpu"], rtol=1e-5, atol=1e-6)   # and 2 ranks equal 1 process


def test_the_offloaded_reference_is_gathered_once_per_pass(tiny_ckpt, monkeypatch):
    """Each reference layer is gathered for its first micro-batch and kept for the rest of the pass (one
    copy to the GPU per pass, not one per micro-batch), then freed."""
    cfg = _kl_config("cpu")
    actor = Actor(load_pretrained(str(tiny_ckpt)), actor_config(cfg), init_distributed("cpu"))
    group = type(actor.ref_model.layers[0]._get_fsdp_state()._fsdp_param_group)
    calls: list[int] = []
    real = group.unshard

    def counting(self, *a, **kw):
        if not self.is_unsharded and self._all_gather_result is None:
            calls.append(id(self))
        return real(self, *a, **kw)
    monkeypatch.setattr(group, "unshard", counting)
    samples = synthetic_samples(LENGTHS)
    steps = batching_config(cfg)
    assert steps.max_tokens_per_gpu == 24   # several micro-batches: 86 tokens in 24-token budgets
    actor.compute_log_probs(samples, steps, "ref")
    num_groups = len(actor.ref_model.layers) + 1   # each layer and the root
    assert len(calls) == num_groups and len(set(calls)) == num_groups
    assert all(not layer._get_fsdp_state()._fsdp_param_group.is_unsharded for layer in actor.ref_model.layers)


def test_auto_placement_rule():
    cuda = torch.device("cuda")
    h200 = 141 * 10**9
    # Qwen3-0.6B and 1.7B stay resident (1.2 / 3.4 GB of 141); 4B and 8B go to the CPU (8 / 16 GB)
    assert not ref_on_cpu("auto", 596_000_000, 1, cuda, False, h200)
    assert not ref_on_cpu("auto", 1_700_000_000, 1, cuda, False, h200)
    assert ref_on_cpu("auto", 4_000_000_000, 1, cuda, False, h200)
    assert not ref_on_cpu("auto", 4_000_000_000, 2, cuda, False, h200)   # 4 GB per rank over 2 ranks
    assert ref_on_cpu("auto", 596_000_000, 1, cuda, True, h200)          # the actor is offloaded: so is it
    assert not ref_on_cpu("auto", 8_000_000_000, 1, torch.device("cpu"), False)
    assert ref_on_cpu("cpu", 1, 1, torch.device("cpu"), False) and not ref_on_cpu("gpu", 8e9, 1, cuda, True, h200)


def test_explicit_gpu_placement_keeps_the_reference_resident_beside_an_offloaded_actor(tiny_ckpt):
    cfg = tiny_config(use_kl_loss=True, fsdp_cpu_offload=True, ref_placement="gpu")
    actor = Actor(load_pretrained(str(tiny_ckpt)), actor_config(cfg), init_distributed("cpu"))
    assert _offloaded(actor.model) and not _offloaded(actor.ref_model)


def test_actor_config_maps_only_explicit_placements():
    assert actor_config(tiny_config(ref_placement="cpu")).ref_on_cpu
    assert not actor_config(tiny_config(ref_placement="auto")).ref_on_cpu   # run set-up resolves auto


@pytest.mark.parametrize("value", ["disk", "GPU"])
def test_bad_placement_is_one_line(value):
    from furlong.config_train_flags import check_train_flags
    with pytest.raises(ValueError, match=r"^--ref-placement: unknown placement"):
        check_train_flags(tiny_config(ref_placement=value))


def test_cli_runs_with_the_reference_on_cpu_and_trains_the_same(tmp_path, capsys):
    """`furlong train --use-kl-loss --ref-placement cpu` says where the reference is and trains exactly as
    the resident reference does; without a KL term the flag is reported unused."""
    from cli_helpers import run_cli
    from test_train_flags_cli import KL, assert_same_training, metrics, train, tiny_assets
    assets = tiny_assets(tmp_path / "assets")
    gpu = train(assets, tmp_path, "gpu", *KL, "--ref-placement", "gpu", num_rollout="2")
    capsys.readouterr()
    cpu = train(assets, tmp_path, "cpu", *KL, "--ref-placement", "cpu", num_rollout="2")
    assert "in CPU memory between passes (--ref-placement cpu)" in capsys.readouterr().out
    assert abs(metrics(cpu)[1]["train/kl_loss"]) > 0 and metrics(cpu) != [] and len(metrics(gpu)) == 2
    assert_same_training(assets, tmp_path, "gpu", "cpu")
    from test_train_flags_cli import argv
    code, _, err = run_cli(argv(assets, tmp_path / "nokl", "--ref-placement", "cpu"), capsys)
    assert code == 0 and "--ref-placement cpu is unused" in err
