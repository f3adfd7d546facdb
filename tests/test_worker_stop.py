"""SIGTERM to a `furlong train` that spawned its own workers (--actor-num-gpus-per-node 2, gloo on the CPU):
forwarded to the workers, which stop at a safe point; one line; exit 143; no worker left running; the
checkpoints intact (launch/worker_stop.py). Also: workers that do not stop are killed after the grace,
and workers whose launcher was SIGKILLed stop by themselves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import tiny_assets  # noqa: E402

from furlong.checkpoint.verify import damage, iteration_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("stop_assets"))


def train_argv(a: Path, out: Path, ck: Path) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", "50",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
            "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), "--save", str(ck),
            "--actor-num-gpus-per-node", "2"]


def workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is `pid` (not multiprocessing's resource tracker)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"spawn_main" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except (OSError, ValueError):
            continue   # exited while we looked
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's reaping is left)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_workers(proc: subprocess.Popen, n: int = 2, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := workers_of(proc.pid)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return pids


def stop_lines(*texts: str) -> list[str]:
    return [ln for t in texts for ln in t.splitlines() if "stopped by signal" in ln]


def test_sigterm_to_the_launcher_mid_run(assets, tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "furlong", *train_argv(assets, out, ck)], cwd=ROOT, env=ENV,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = wait_for_workers(proc)
    for line in proc.stdout:
        if line.startswith("[rollout 1/50]"):
            proc.send_signal(signal.SIGTERM)       # the launcher only; it forwards to its workers
            break
    rest, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and not err.strip(), err
    [line] = stop_lines(rest, err)
    assert line.startswith("furlong: stopped by signal 15 after rollout ") and f"--load {ck}" in line
    done = int(line.split("after rollout ")[1].split("/")[0])
    assert not [p for p in pids if running(p)]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)
    assert damage(iteration_path(ck, done)) is None and not list(ck.glob("*.tmp"))
    steps = [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(done))


def test_sigterm_to_the_launcher_while_workers_start(assets, tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "furlong", *train_argv(assets, out, ck)], cwd=ROOT, env=ENV,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = wait_for_workers(proc)
    proc.send_signal(signal.SIGTERM)               # before any step: importing, loading the model
    rest, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    [line] = stop_lines(rest, err)
    assert line.startswith("furlong: stopped by signal 15 (SIGTERM) outside a training step") and line in err
    assert not [p for p in pids if running(p)]
    assert not ck.exists() or not list(ck.glob("iter_*"))


def _toy_launcher(tmp_path: Path, grace_s: float, mode: str) -> tuple[subprocess.Popen, list[int]]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers_for_stop_tests.py"), str(pid_dir),
                             str(grace_s), mode], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(pid_dir.glob("*.pid"))) < 2:    # both workers are in their function
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc, [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def test_workers_that_do_not_stop_are_killed_after_the_grace(tmp_path):
    proc, pids = _toy_launcher(tmp_path, 1.0, "ignore")
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t < 30               # 1 s of grace, not the workers' forever
    assert proc.returncode == 128 + signal.SIGTERM, err
    [line] = err.strip().splitlines()
    assert "stopped by signal 15 (SIGTERM); 2 worker(s) had not stopped 1s later and were killed" in line, line
    assert not [p for p in pids if running(p)]


def test_a_second_signal_ends_the_grace_at_once(tmp_path):
    proc, pids = _toy_launcher(tmp_path, 600.0, "ignore")
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None                     # still within its 600 s of grace
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err   # the first signal names the stop
    assert "2 worker(s) had not stopped 600s later and were killed" in err
    assert not [p for p in pids if running(p)]


def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    proc, pids = _toy_launcher(tmp_path, 600.0, "plain")
    proc.kill()                                    # SIGKILL: the launcher can forward nothing
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while [p for p in pids if running(p)]:
        assert time.monotonic() < deadline, "a worker outlived its launcher"
        time.sleep(0.1)


def test_a_failure_is_reported_not_the_stop_of_the_ranks_terminated_after_it(tmp_path):
    """The launcher ends the other ranks when one fails; they report no stop line that could displace it."""
    from furlong.launch.distributed import WorkerError, launch_local
    from workers_for_stop_tests import rank_1_fails
    with pytest.raises(WorkerError) as info:
        launch_local(rank_1_fails, 2, str(tmp_path))
    assert (info.value.rank, info.value.code, info.value.line) == (1, 1, "ValueError: --lr: rank 1 says no")
