"""bench/rollout_time_split.py: the fit recovers known costs, and the traced engine loop counts what
engine.generate would produce (CPU, tiny model)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rollout_time_split", ROOT / "bench" / "rollout_time_split.py")
rts = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = rts          # its dataclasses look their module up
spec.loader.exec_module(rts)


def test_fit_recovers_fixed_row_and_token_costs():
    g = torch.Generator().manual_seed(0)
    a, b, c = 1.5e-3, 2e-6, 4e-9                 # s per step, s per padded row, s per attended token
    samples = []
    for i in range(40):
        rows = int(torch.randint(1, 256, (1,), generator=g))
        ctx = rows * int(torch.randint(100, 8000, (1,), generator=g))
        steps = 16 if i % 5 else 7
        samples.append(rts.StepSample(steps, rows, rows, ctx, steps * (a + b * rows + c * ctx), False))
    samples.append(rts.StepSample(0, 0, 0, 0, 0.25, True))            # a prefill-only step: the residual
    samples.append(rts.StepSample(16, 64, 64, 64 * 900, 0.5, False, captured=True))   # a capture: residual too
    f = rts.fit_time_split(samples, kv_bytes_per_token=59136)
    assert f.fixed_ms_per_step == pytest.approx(1.5, rel=1e-6) and f.ms_per_row == pytest.approx(2e-3, rel=1e-6)
    assert f.ns_per_context_token == pytest.approx(4.0, rel=1e-6) and f.r2 == pytest.approx(1.0)
    assert f.implied_attention_tb_s == pytest.approx(59136 / 4e-9 / 1e12)
    assert f.residual_s == pytest.approx(0.75, abs=1e-9)
    assert f.fixed_s + f.rows_s + f.attention_s + f.residual_s == pytest.approx(f.seconds)
    # the capture window counted at its fitted cost instead of its 0.5 s
    assert f.steady_seconds == pytest.approx(f.seconds - 0.5 + 16 * (a + b * 64 + c * 64 * 900), rel=1e-9)


def test_fit_refuses_too_few_windows():
    with pytest.raises(ValueError, match="decode windows"):
        rts.fit_time_split([rts.StepSample(16, 4, 4, 40, 0.01, False)] * 2, 100.0)


def test_traced_generate_counts_every_step_of_a_tiny_rollout(tmp_path):
    from furlong.bench.generation_parts import _rollout_requests, make_engine
    from furlong.bench.state import Bench
    from furlong.bench.workload import load_workload
    from test_bench import tiny_workload
    path = tmp_path / "w.json"
    path.write_text(json.dumps(tiny_workload()))
    w = load_workload(path)
    b = Bench(w)
    prompts = [list(range(1, p + 1)) for p in w.prompt_lens]
    engine = make_engine(b, max(w.prompt_lens) + max(w.response_lens))
    samples = rts.traced_generate(engine, _rollout_requests(b, prompts, seed=0))
    stats = engine.reset_stats()
    assert sum(s.num_steps for s in samples) == stats.num_decode_steps > 0
    assert sum(s.num_steps * s.num_rows for s in samples) == stats.num_decode_rows
    assert sum(s.seconds for s in samples) == pytest.approx(stats.seconds)
    assert any(s.prefill for s in samples) and all(s.padded_rows == s.num_rows for s in samples)   # CPU: no buckets
    assert not any(s.captured for s in samples)                         # nor graphs


def test_script_writes_the_split_and_its_plot(tmp_path):
    import subprocess
    from test_bench import tiny_workload
    w = tiny_workload()
    w["rollout"].update(max_response_len=64, response_lens=[40, 60, 20, 50, 30, 45])   # several 16-step windows
    path = tmp_path / "w.json"
    path.write_text(json.dumps(w))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_time_split.py"), "--workload", str(path),
                          "--kv-dtype", "auto,fp8_e4m3", "--split-rule", "waves,programs", "--fp8-kernel",
                          "padded,transposed", "--overlap-rows", "0,3", "--out", str(tmp_path / "out")], capture_output=True,
                         text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "rollout_time_split.json").read_text())
    # the transposed kernel's runs for the fp8 cache only (on the CPU both run the reference attention);
    # each run again with windows of >= 3 rows as two halves (overlap.py)
    runs = ({f"{kv} {rule}" for kv in ("auto", "fp8_e4m3") for rule in ("waves", "programs")}
            | {f"fp8_e4m3 {rule} transposed" for rule in ("waves", "programs")})
    assert set(report) == runs | {f"{r} halves>=3" for r in runs}
    for kv, r in report.items():
        assert sum(s["num_steps"] for s in r["steps"]) == 59          # the longest row: 60 tokens, 1 from prefill
        assert r["split"]["seconds"] > 0 and "R^2" in run.stdout
        assert r["split"]["steady_seconds"] == pytest.approx(r["split"]["seconds"])   # CPU: no graphs captured
    assert report["fp8_e4m3 waves"]["kv_bytes_per_token"] < report["auto waves"]["kv_bytes_per_token"]
    assert (tmp_path / "out" / "rollout_time_split.png").stat().st_size > 10_000
