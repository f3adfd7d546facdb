"""--optimizer-cpu-offload's flags and host-memory check: the conflict with --fsdp-cpu-offload, the bytes
the moments need on the host, a CLI run that trains or stops with one line (trainer/optimizer_offload.py,
run/host_memory.py), and Megatron's --overlap-cpu-optimizer-d2h-h2d beside it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import tiny_config  # noqa: E402

from furlong.run import host_memory  # noqa: E402
from furlong.run.host_memory import GIB, HEADROOM, MOMENT_BYTES, offload_host_bytes  # noqa: E402


def test_with_fsdp_cpu_offload_is_one_line_exit_2(tmp_path, capsys):
    from cli_helpers import one_line, run_cli
    from test_train_flags_cli import argv
    code, _, err = run_cli(argv(tmp_path, tmp_path / "run", "--optimizer-cpu-offload", "--fsdp-cpu-offload"), capsys)
    assert code == 2
    line = one_line(err, "--optimizer-cpu-offload", "--fsdp-cpu-offload")
    assert line.startswith("furlong: error: --optimizer-cpu-offload: cannot be combined with --fsdp-cpu-offload")
    assert not (tmp_path / "run").exists()


def test_host_bytes_for_the_moments():
    n = 8_190_735_360                                    # Qwen3-8B's parameters
    moments = offload_host_bytes(n, n, 0, 0, 1, 1, MOMENT_BYTES)
    assert moments == int(8 * n * HEADROOM) and 60 < moments / GIB < 65   # fits a 128 GiB host's ~120 available
    assert moments < offload_host_bytes(n, n, 2, 0, 1, 1) / 2 + 1          # half of --fsdp-cpu-offload's 16 B
    assert offload_host_bytes(n, n, 0, 0, 8, 8, MOMENT_BYTES) == pytest.approx(moments / 1, abs=8)   # one host
    assert offload_host_bytes(n, n, 0, 0, 8, 4, MOMENT_BYTES) == pytest.approx(moments / 2, abs=1)   # two hosts
    # LoRA: the adapters' moments only; the frozen base stays on the GPU; a CPU reference at 2 bytes
    lora = offload_host_bytes(n + 50_000_000, 50_000_000, 0, 2, 1, 1, MOMENT_BYTES)
    assert lora == int((50_000_000 * 8 + (n + 50_000_000) * 2) * HEADROOM)


def test_qwen3_8b_moments_check_names_the_flag(monkeypatch):
    from furlong.bench.workload import load_workload
    from furlong.models.hf_config import ModelArgs
    repo = Path(__file__).resolve().parents[1]
    args = ModelArgs.from_hf_config(load_workload(str(repo / "bench" / "qwen3_8b_workload.json")).model,
                                    source="workload model")
    cfg = tiny_config(optimizer_cpu_offload=True)
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": 120 * GIB)
    host_memory.check_offload_host_memory(cfg, args, 1, False, 2)            # 61 GiB of moments: fits
    cfg.parallel.optimizer_cpu_offload, cfg.parallel.fsdp_cpu_offload = False, True
    with pytest.raises(ValueError, match=r"^--fsdp-cpu-offload: "):          # 16 B per parameter: does not
        host_memory.check_offload_host_memory(cfg, args, 1, False, 2)
    cfg.parallel.optimizer_cpu_offload, cfg.parallel.fsdp_cpu_offload = True, False
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": 50 * GIB)
    with pytest.raises(ValueError, match=r"^--optimizer-cpu-offload: .* 8\.19B parameters needs ~6\d GiB .* 50 GiB"):
        host_memory.check_offload_host_memory(cfg, args, 1, False, 2)


def test_cli_run_trains_or_stops_with_one_line(tmp_path, capsys, monkeypatch):
    from cli_helpers import one_line, run_cli, tiny_assets
    from test_train_flags_cli import argv
    assets = tiny_assets(tmp_path / "assets")
    out = tmp_path / "run"
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda meminfo="/proc/meminfo": 1000)
    code, _, err = run_cli(argv(assets, out, "--optimizer-cpu-offload"), capsys)
    assert code == 2 and not out.exists()
    assert one_line(err).startswith("furlong: error: --optimizer-cpu-offload: the offloaded training state")
    monkeypatch.undo()
    code, _, err = run_cli(argv(assets, out, "--optimizer-cpu-offload"), capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("perf/optimizer_step_time", 0) > 0 for x in lines)


def test_megatrons_overlap_flag_is_accepted_and_noted_without_the_offload():
    """Megatron recipes pair --optimizer-cpu-offload with --overlap-cpu-optimizer-d2h-h2d: accepted (the offloaded
    optimizer always overlaps its copies); alone it is noted at start-up as having no effect."""
    from furlong.config import Config
    from furlong.config_debug_flags import start_up_notes
    from furlong.miles_flags import answer, furlong_flags
    assert answer("--overlap-cpu-optimizer-d2h-h2d", furlong_flags())[0] == "accepted"
    cfg = Config()
    cfg.parallel.overlap_cpu_optimizer_d2h_h2d = True
    assert "--overlap-cpu-optimizer-d2h-h2d: no effect without --optimizer-cpu-offload" in start_up_notes(cfg)
    cfg.parallel.optimizer_cpu_offload = True
    assert not any("overlap" in n for n in start_up_notes(cfg))
