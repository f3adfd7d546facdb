"""--fsdp-cpu-offload's host-memory check: the CPU bytes the offloaded state needs (16 per trained
parameter, the frozen base and a CPU reference in the compute dtype, sharded over the ranks of one host),
MemAvailable read from /proc/meminfo, and a run that would not fit stopping with one line before anything
is built or written (the alternative, seen on the device: the OOM killer's SIGKILL, exit 137, no message)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from furlong.run import host_memory  # noqa: E402
from furlong.run.host_memory import (GIB, HEADROOM, check_offload_fits, mem_available_bytes,  # noqa: E402
                                     offload_host_bytes)


def test_offload_host_bytes_arithmetic():
    n = 8_190_735_360                                    # Qwen3-8B's parameters
    full = offload_host_bytes(n, n, 2, 0, world_size=1, local_world_size=1)
    assert full == int(16 * n * HEADROOM) and full / GIB > 125   # more than a 128 GiB host has available
    # two hosts of 4 ranks: each host holds half
    assert offload_host_bytes(n, n, 2, 0, 8, 4) == pytest.approx(full / 2, abs=1)
    # LoRA: 50M adapters at 16 bytes, the base at 2, a CPU reference at 2 more
    lora = offload_host_bytes(n + 50_000_000, 50_000_000, 2, 2, 1, 1)
    assert lora == int((50_000_000 * 16 + n * 2 + (n + 50_000_000) * 2) * HEADROOM)


def test_mem_available_is_read_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   120000000 kB\n")
    assert mem_available_bytes(f) == 120000000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert mem_available_bytes(f) is None
    assert mem_available_bytes(tmp_path / "absent") is None


def test_fits_or_one_line_naming_the_flag():
    check_offload_fits(10 * GIB, 11 * GIB, 10**9, lora=False)
    check_offload_fits(10 * GIB, None, 10**9, lora=False)          # unknown: no check
    with pytest.raises(ValueError, match=r"^--fsdp-cpu-offload: .* 8\.19B parameters needs ~131 GiB .* 120 GiB is "
                                         r"available; train LoRA adapters instead \(--lora-rank"):
        check_offload_fits(131 * GIB, 120 * GIB, 8_190_735_360, lora=False)


def test_cli_stops_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """A train run whose offloaded state would not fit: exit 2, one line, no output directory."""
    from cli_helpers import run_cli
    from test_train_flags_cli import argv, tiny_assets
    assets = tiny_assets(tmp_path / "assets")
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": 1000)
    out = tmp_path / "run"
    code, _, err = run_cli(argv(assets, out, "--fsdp-cpu-offload"), capsys)
    assert code == 2 and err.strip().startswith("furlong: error: --fsdp-cpu-offload: the offloaded training state")
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    # the same run with room trains (the check passes on this machine's real MemAvailable)
    monkeypatch.undo()
    code, _, err = run_cli(argv(assets, out, "--fsdp-cpu-offload"), capsys)
    assert code == 0, err


def test_ppo_critic_counts_on_the_host(monkeypatch):
    """A ppo run's critic is offloaded with the actor's flags: its decoder without lm_head plus the value
    head count at the same bytes per parameter, so a host that holds the actor alone is refused."""
    import dataclasses
    import math

    from furlong.config import Config
    from furlong.models.hf_config import ModelArgs
    from furlong.models.hf_io import param_shapes
    args = ModelArgs(model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    from furlong.models.decoder import Transformer
    from furlong.models.value_model import ValueModel
    n = sum(math.prod(s) for s in param_shapes(args).values())
    critic = sum(p.numel() for p in ValueModel(Transformer(args)).parameters())    # the critic run set-up builds
    assert host_memory.critic_num_params(args) == critic < n
    for moments, per in ((False, 16), (True, 8)):
        cfg = Config()
        cfg.parallel = dataclasses.replace(cfg.parallel, fsdp_cpu_offload=not moments, optimizer_cpu_offload=moments)
        actor = offload_host_bytes(n, n, 2, 0, 1, 1, per)
        both = actor + offload_host_bytes(critic, critic, 0, 0, 1, 1, per)
        monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": both)
        host_memory.check_offload_host_memory(cfg, args, 1, False, 2, args)      # exactly fits
        monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": actor + 1)
        host_memory.check_offload_host_memory(cfg, args, 1, False, 2)             # no critic: fits
        flag = "--optimizer-cpu-offload" if moments else "--fsdp-cpu-offload"
        with pytest.raises(ValueError, match=f"^{flag}: the offloaded training state of "):
            host_memory.check_offload_host_memory(cfg, args, 1, False, 2, args)


def test_ppo_cli_checks_the_critic(tmp_path, capsys, monkeypatch):
    """`furlong train --advantage-estimator ppo --fsdp-cpu-offload` passes the critic's decoder to the
    check (its parameters counted beside the actor's), before anything is written."""
    import math

    from cli_helpers import run_cli
    from test_train_flags_cli import argv, tiny_assets

    from furlong.models.hf_io import check_pretrained, param_shapes
    assets = tiny_assets(tmp_path / "assets")
    args = check_pretrained(assets / "ckpt")[0]
    seen = []

    def record(needed, available, num_params, lora, flag="--fsdp-cpu-offload"):
        seen.append(num_params)
        raise ValueError(f"{flag}: recorded")
    monkeypatch.setattr(host_memory, "check_offload_fits", record)
    out = tmp_path / "run"
    code, _, err = run_cli(argv(assets, out, "--fsdp-cpu-offload", "--advantage-estimator", "ppo"), capsys)
    assert code == 2 and err.strip() == "furlong: error: --fsdp-cpu-offload: recorded" and not out.exists()
    assert seen == [sum(math.prod(s) for s in param_shapes(args).values()) + host_memory.critic_num_params(args)]
