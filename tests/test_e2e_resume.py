"""End-to-end `furlong train` runs that stop and resume: exact resume from a checkpoint, resuming
into the same run directory, a used --output-dir refused, SIGINT to one process and to the
launcher of two workers, a closed stdout, --load of another model's checkpoint or of garbage,
and a full disk during a save. One CPU process with a tiny random checkpoint unless noted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_e2e import ROOT, _resume_flags, assets, read_metrics, run_proc  # noqa: E402,F401 (assets: fixture)
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402


def test_resume_continues_exactly(assets, tmp_path, capsys):
    from safetensors.torch import load_file
    ck = tmp_path / "ck"
    assert main(_resume_flags(assets, tmp_path / "fresh", 3, "--save", str(tmp_path / "fresh_ck"))) == 0
    assert main(_resume_flags(assets, tmp_path / "first", 2, "--save", str(ck), "--save-interval", "1")) == 0
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    capsys.readouterr()
    assert main(_resume_flags(assets, tmp_path / "resumed", 3, "--load", str(ck),
                              "--save", str(tmp_path / "resumed_ck"))) == 0
    out = capsys.readouterr().out
    assert "[rollout 3/3]" in out and "[rollout 2/3]" not in out
    fresh, resumed = read_metrics(tmp_path / "fresh"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [2]
    # Measured: bit-identical on the CPU (same seeds, same op order), so compare exactly.
    # num_tokens checks the data sampler's position; log-probs, entropy and grad norm the weights.
    a, b = fresh[2], resumed[0]
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "train/num_tokens", "rollout/rollout_log_probs",
                "train/loss", "train/grad_norm", "train/entropy"):
        assert a[key] == b[key], key
    # the run changed the weights enough for a lost model state to show
    assert fresh[0]["rollout/rollout_log_probs"] != pytest.approx(fresh[2]["rollout/rollout_log_probs"], rel=1e-3)
    # rollout 3's update used the restored Adam moments: the final weights match only if they were restored
    for run in ("fresh", "resumed"):
        assert main(["export", "--load", str(tmp_path / f"{run}_ck"), "--output", str(tmp_path / f"{run}_hf"),
                     "--hf-checkpoint", str(assets / "ckpt")]) == 0
    wa = load_file(str(next((tmp_path / "fresh_hf").glob("*.safetensors"))))
    wb = load_file(str(next((tmp_path / "resumed_hf").glob("*.safetensors"))))
    w0 = load_file(str(next((assets / "ckpt").glob("*.safetensors"))))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.layers.0.mlp.down_proj.weight"], w0["model.layers.0.mlp.down_proj.weight"])


def test_resume_into_the_same_run_dir_logs_every_step_once(assets, tmp_path, capsys):
    """A run killed after rollout 3's metrics line but before its checkpoint (tracker still at rollout 2)
    resumes into the same --output-dir: metrics.jsonl ends with every step exactly once, in order."""
    out, ck = tmp_path / "run", tmp_path / "ck"
    assert main(_resume_flags(assets, out, 2, "--save", str(ck), "--save-interval", "2")) == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"   # rollouts done
    with open(out / "metrics.jsonl", "a") as f:                          # rollout 3 logged, then killed
        f.write('{"kind": "rollout", "step": 2, "train/loss": 9.0}\n{"kind": "rollout", "step": 3, "torn')
    capsys.readouterr()
    assert main(_resume_flags(assets, out, 4, "--load", str(ck), "--save", str(ck))) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "saved checkpoint" in printed and f"run directory: {out}" in printed
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[2]["train/loss"] != 9.0


def test_used_output_dir_is_refused_without_load_or_overwrite(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_resume_flags(assets, out, 1)) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(_resume_flags(assets, out, 1)) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "already holds a run" in err and len(err.strip().splitlines()) == 1
    assert (out / "metrics.jsonl").read_text() == before                 # nothing touched
    assert main(_resume_flags(assets, out, 1, "--overwrite")) == 0
    assert [r["step"] for r in read_metrics(out)] == [0]


def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "furlong", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigint_stops_after_the_step_saves_and_resumes(assets, tmp_path):
    import signal
    out, ck = tmp_path / "run", tmp_path / "ck"
    proc = _start(_resume_flags(assets, out, 50, "--save", str(ck)))
    for line in proc.stdout:
        if line.startswith("[rollout 1/50]"):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    stopped = [ln for ln in rest.splitlines() if "stopped by signal" in ln]
    assert len(stopped) == 1 and f"--load {ck}" in stopped[0]
    done = int(stopped[0].split("after rollout ")[1].split("/")[0])
    assert [r["step"] for r in read_metrics(out)] == list(range(done))
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)
    p = run_proc(_resume_flags(assets, out, done + 1, "--load", str(ck)), timeout=120)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in read_metrics(out)] == list(range(done + 1))


def test_closed_stdout_does_not_stop_training(assets, tmp_path):
    out = tmp_path / "run"
    proc = _start(_resume_flags(assets, out, 3))
    proc.stdout.readline()            # `| head -1`: read one line, then close the pipe
    proc.stdout.close()
    assert proc.wait(timeout=180) == 0, proc.stderr.read()
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]


def test_load_of_another_models_checkpoint_or_garbage_is_one_line(assets, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(_resume_flags(assets, tmp_path / "a", 1, "--save", str(ck))) == 0
    other = write_tiny_checkpoint(tmp_path / "other", vocab_size=128, hidden=48, layers=2, heads=2, kv_heads=1,
                                  max_position_embeddings=2048)
    argv = _resume_flags(assets, tmp_path / "b", 2, "--load", str(ck))
    argv[argv.index("--hf-checkpoint") + 1] = str(other)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("furlong: error: --load:") and "another model" in err and len(err.splitlines()) == 1
    (ck / "iter_0000001" / "trainer.pt").write_bytes(b"garbage")
    assert main(_resume_flags(assets, tmp_path / "c", 2, "--load", str(ck))) == 2
    err = capsys.readouterr().err.strip()
    assert "--load:" in err and len(err.splitlines()) == 1


def test_sigint_to_the_launcher_stops_two_workers_gracefully(assets, tmp_path):
    import signal
    out, ck = tmp_path / "run", tmp_path / "ck"
    proc = _start(_resume_flags(assets, out, 50, "--save", str(ck), "--actor-num-gpus-per-node", "2"))
    for line in proc.stdout:
        if line.startswith("[rollout 1/50]"):
            proc.send_signal(signal.SIGINT)          # the launcher only; it forwards to its workers
            break
    rest, err = proc.communicate(timeout=180)
    assert proc.returncode >= 128, err
    assert "Traceback" not in err
    stopped = [ln for ln in rest.splitlines() if "stopped by signal" in ln]
    assert len(stopped) == 1
    done = int(stopped[0].split("after rollout ")[1].split("/")[0])
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)
    assert [r["step"] for r in read_metrics(out)] == list(range(done))


def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_checkpoint(assets, tmp_path, capsys, monkeypatch):
    import errno
    from furlong.checkpoint import store as ckpt_mod
    real_save, calls = ckpt_mod.dcp.save, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.dcp, "save", full_disk)
    ck = tmp_path / "ck"
    assert main(_resume_flags(assets, tmp_path / "run", 3, "--save", str(ck), "--save-interval", "1")) == 1
    err = capsys.readouterr().err.strip()
    assert "no space left on the device" in err and "iter_0000001" in err and "intact" in err
    assert len(err.splitlines()) == 1
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not list(ck.glob("*.tmp"))                     # no half-written shards left behind
    monkeypatch.setattr(ckpt_mod.dcp, "save", real_save)
    assert main(_resume_flags(assets, tmp_path / "run", 3, "--load", str(ck))) == 0   # the kept one loads
