"""Runs launched by torchrun on the CPU (gloo, localhost): 2 nodes x 1 process and 1 node x 2 processes
equal one process; a worker killed with SIGKILL stops the other in one line; --max-restarts heals it.

"Nodes" are two torchrun invocations on this machine with --nnodes 2 --node-rank 0/1 and
--master-addr 127.0.0.1, exactly the README's multi-node commands. Equality with one process is up
to float32 reduction order: FSDP's reduce-scatter sums the two ranks' partial gradients, one process
sums all micro-batches in one order (measured: weights differ by <= 3e-7 after 4 Adam steps that move
them by 0.04), so weights and float metrics are compared with a tight tolerance and the samples
(rewards, lengths, token counts) exactly. A healed run equals the uninterrupted run at the same
world size exactly (a resume is bit-exact, as tests/test_faults.py shows for one process).

The kill is from outside (`kill -9` of node 1's worker, found as the child of its torchrun) once rank 0
has printed that iter_0000002 is saved, so it lands at the end of rank 1's save of rollout 2 or in rollout
3; the line must name rank 1 (node 1), the stage it had published and the last complete checkpoint,
iter_0000002.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402
from furlong.launch.distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # so --custom-rm-path tests.rewards_for_tests.* imports in-process
    sys.path.insert(0, str(ROOT))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]   # `torchrun`, from this interpreter
NUM_ROLLOUT = 4
# per-rank by definition (micro-batches this rank ran, its token balance), so not compared across world sizes
PER_RANK = ("train/num_micro_batches", "train/tokens_max_over_mean")

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker to kill in /proc")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("multinode_assets")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(d / "data", 16, 2, 0)
    return d


def train_flags(a: Path, run: Path, *extra: str) -> list[str]:
    # hash_reward varies within groups, so every step has non-zero advantages and moves the weights
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", str(NUM_ROLLOUT),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
            "--lr", "1e-2", "--device", "cpu", "--output-dir", str(run / "out"), "--save", str(run / "ck"),
            "--save-interval", "2", *extra]


def torchrun(nnodes: int, nproc: int, flags: list[str], *launch: str, gpu_per_node: bool = False
             ) -> list[subprocess.Popen]:
    """One torchrun per node, as on a cluster (the README's commands); returns them by node rank.
    gpu_per_node: node i sees only GPU i (CUDA_VISIBLE_DEVICES), as separate machines would."""
    # PYTHONFAULTHANDLER: a worker sent SIGABRT prints every thread's Python stack (finish, on a hang)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    port = str(free_port())
    return [subprocess.Popen([*TORCHRUN, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank",
                              str(node), "--master-addr", "127.0.0.1", "--master-port", port, *launch,
                              "-m", "furlong", *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**env, "CUDA_VISIBLE_DEVICES": str(node)} if gpu_per_node else env, text=True)
            for node in range(nnodes)]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    """Each node's (exit code, stdout, stderr), all within `timeout` seconds. On a hang the workers get
    SIGABRT first, so the failure shows where each one waited, and nothing is left running."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            for worker in _children(p.pid):
                os.kill(worker, signal.SIGABRT)
        time.sleep(5)
        report = []
        for node, p in enumerate(procs):
            for pid in [*_children(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stdout, stderr = p.communicate()
            report.append(f"--- node {node} stdout:\n{(stdout or '')[-2000:]}\n--- node {node} stderr:\n"
                          f"{(stderr or '')[-6000:]}")
        pytest.fail(f"the run did not end within {timeout:.0f} s; its workers' stacks:\n" + "\n".join(report))
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "out" / "metrics.jsonl").read_text().splitlines()]


def samples_and_values(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("perf/", "memory/")) and k not in PER_RANK}


def final_weights(run: Path, assets: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    hf = run / "hf"
    # one export per run: several tests compare against the same run, and export refuses a used target
    if not hf.exists():
        assert main(["export", "--load", str(run / "ck"), "--output", str(hf), "--hf-checkpoint",
                     str(assets / "ckpt")]) == 0
    return load_file(str(next(hf.glob("*.safetensors"))))


def assert_same_run(got: Path, want: Path, assets: Path, exact: bool) -> None:
    a, b = rows(got), rows(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(NUM_ROLLOUT))
    for ra, rb in zip(a, b):
        ra, rb = samples_and_values(ra), samples_and_values(rb)
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == (rb[k] if exact else pytest.approx(rb[k], rel=1e-5, abs=1e-6)), (ra["step"], k)
    wa, wb = final_weights(got, assets), final_weights(want, assets)
    assert wa.keys() == wb.keys()
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("one_process")
    assert main(train_flags(assets, run)) == 0
    first, last = rows(run)[0], rows(run)[-1]
    assert first["rollout/rollout_log_probs"] != last["rollout/rollout_log_probs"]   # the weights moved
    return run


@pytest.fixture(scope="module")
def two_nodes(assets, tmp_path_factory):
    """2 nodes x 1 process, uninterrupted (also the reference of the healed run)."""
    run = tmp_path_factory.mktemp("two_nodes")
    results = finish(torchrun(2, 1, train_flags(assets, run)))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert "[rollout 4/4]" in results[0][1]    # rank 0 (node 0) prints the progress
    return run


def test_two_nodes_of_one_process_equal_one_process(assets, one_process, two_nodes):
    assert_same_run(two_nodes, one_process, assets, exact=False)


def test_one_node_of_two_processes_equals_one_process(assets, one_process, tmp_path):
    [(code, out, err)] = finish(torchrun(1, 2, train_flags(assets, tmp_path)))
    assert code == 0, err[-3000:]
    assert_same_run(tmp_path, one_process, assets, exact=False)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def kill_node_1_worker_after_iter_2(procs: list[subprocess.Popen]) -> list[str]:
    """Read node 0's stdout until rank 0 reports iter_0000002 saved, then SIGKILL node 1's worker.
    Returns the stdout lines read so far."""
    seen = []
    for line in procs[0].stdout:
        seen.append(line)
        if "saved checkpoint" in line and "iter_0000002" in line:
            break
    else:
        raise AssertionError("".join(seen) + procs[0].stderr.read()[-3000:])
    [worker] = _children(procs[1].pid)
    os.kill(worker, signal.SIGKILL)
    return seen


LINE = re.compile(r"rank 1 \(node 1\) stopped during the (generation|reward shaping|old log-prob pass|reference log-prob pass|advantage step|train step|weight sync|"
                  r"checkpoint save) of rollout [234]; last complete checkpoint: (\S+)iter_0000002; resume: "
                  r"torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 .* -m furlong train .*--load (\S+)")


def test_lost_worker_stops_the_other_in_one_line(assets, tmp_path):
    ck = tmp_path / "ck"
    procs = torchrun(2, 1, train_flags(assets, tmp_path, "--num-rollout", "40", "--load", str(ck)))
    kill_node_1_worker_after_iter_2(procs)
    t = time.monotonic()
    [(code0, out0, err0), (code1, _, err1)] = finish(procs, timeout=90)
    assert time.monotonic() - t < 60 and code0 != 0 and code1 != 0
    ours = [ln for ln in err0.splitlines() if ln.startswith("furlong:")]
    assert len(ours) == 1 and LINE.search(ours[0]), err0[-3000:]
    # no traceback from furlong's worker (torchrun's own agent still prints its ChildFailedError summary,
    # whose root cause now shows the line instead of "To enable traceback see ...")
    assert "[rank0]" not in err0 and "furlong/" not in err0.replace(ours[0], ""), err0[-3000:]
    assert err0.count(ours[0].removeprefix("furlong: error: ")) == 2
    # the checkpoint the line names is intact and resumable: its shards read back
    from furlong.checkpoint.verify import damage, latest_iteration
    assert latest_iteration(ck) == 2 and damage(ck / "iter_0000002") is None
    assert [r["step"] for r in rows(tmp_path)][:2] == [0, 1]


def test_max_restarts_heal_a_lost_worker_to_the_uninterrupted_result(assets, two_nodes, tmp_path):
    # --use-fault-tolerance: --load defaults to --save, so the restarted workers resume from it
    procs = torchrun(2, 1, train_flags(assets, tmp_path, "--use-fault-tolerance"), "--max-restarts", "1")
    kill_node_1_worker_after_iter_2(procs)
    [(code0, out0, err0), (code1, _, err1)] = finish(procs)
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    assert "torchrun restarts the workers (restart 1 of 1), which resume from it" in err0
    assert "resumed from iteration 2" in out0
    assert_same_run(tmp_path, two_nodes, assets, exact=True)   # metrics once per rollout, same weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_lost_worker_ends_by_the_timeout_in_one_line(assets, tmp_path):
    """NCCL does not see a dead peer's socket: the survivor waits in its collective until
    --distributed-timeout-minutes (1 here), then the watchdog aborts the communicator
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) and the waiting call raises into the one-line report."""
    flags = train_flags(assets, tmp_path, "--num-rollout", "400", "--distributed-timeout-minutes", "1")
    flags[flags.index("--device") + 1] = "cuda"
    procs = torchrun(2, 1, flags, gpu_per_node=True)
    kill_node_1_worker_after_iter_2(procs)
    t = time.monotonic()
    [(code0, _, err0), _] = finish(procs, timeout=300)
    assert code0 != 0 and time.monotonic() - t < 180, err0[-3000:]
    ours = [ln for ln in err0.splitlines() if ln.startswith("furlong:")]
    assert len(ours) == 1 and LINE.search(ours[0]), err0[-3000:]
