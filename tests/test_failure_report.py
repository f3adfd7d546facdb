"""The one line of a failed multi-rank run (furlong/launch/failure.py), in-process with a dict store:
which rank is named and how, the resume command (it parses back to the same Config), the collective-
error test, the new flags' checks and the timeout reaching init_process_group. The same paths under
real torchrun processes are tests/test_multinode.py."""
from __future__ import annotations

import datetime
import shlex

import pytest
import torch

from furlong.cli import parse_config
from furlong.launch import distributed, failure
from furlong.launch.failure import Position, is_collective_failure, resume_command, stop_report


class DictStore:
    """The calls failure.py makes of a c10d store (set/check/get), over a dict."""

    def __init__(self, data: dict[str, str] | None = None, broken: bool = False):
        self.data, self.broken = dict(data or {}), broken

    def set(self, key, value):
        if self.broken:
            raise RuntimeError("store gone")
        self.data[key] = value

    def check(self, keys):
        if self.broken:
            raise RuntimeError("store gone")
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key].encode()


def cfg_of(tmp_path, *extra):
    return parse_config(["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rm-type", "math", "--save", str(tmp_path / "ck"),
                         "--num-rollout", "5", "--lr", "1e-5", *extra])


PEER_RESET = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45470")


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(failure, "GRACE_S", 0.3)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")


def test_a_silent_rank_is_named_with_the_stage_it_published(tmp_path):
    store = DictStore()
    peer = Position(rank=3, node=1, store=store)
    with peer.stage("actor_train", 2):
        pass
    me = Position(rank=0, node=0, store=store)
    with me.stage("old_log_probs", 2):
        pass
    store.set("furlong/survived/1", "1")        # rank 1 saw the failure too; rank 2 said nothing either
    line = stop_report(PEER_RESET, me, 4, cfg_of(tmp_path), "train", None)
    assert line.startswith("rank 2 (node 1) stopped during an unknown stage (ranks 3 too);"), line
    assert f"no complete checkpoint in {tmp_path / 'ck'} yet; resume: furlong train " in line


def test_the_lost_rank_line_and_its_resume_command_parse_back(tmp_path):
    store = DictStore()
    with Position(rank=1, node=1, store=store).stage("actor_train", 2):
        pass
    cfg = cfg_of(tmp_path, "--use-fault-tolerance", "--rollout-stop", "a b", "x")
    line = stop_report(PEER_RESET, Position(rank=0, node=0, store=store), 2, cfg, "train", None)
    head, _, cmd = line.partition("; resume: ")
    assert head == f"rank 1 (node 1) stopped during the train step of rollout 3; no complete checkpoint in {tmp_path / 'ck'} yet"
    argv = shlex.split(cmd)
    assert argv[:2] == ["furlong", "train"]
    back = parse_config(argv[2:])
    cfg.ckpt.load = cfg.ckpt.save
    assert back == cfg


def test_a_rank_that_raised_is_named_with_its_own_line(tmp_path):
    store = DictStore()
    bad = Position(rank=1, node=0, store=store)
    with bad.stage("rollout", 0):
        pass
    own = stop_report(ValueError("x"), bad, 2, cfg_of(tmp_path), "train", "furlong: error: --reward: broke")
    assert own == "furlong: error: --reward: broke"          # the raising rank's line is its own
    line = stop_report(PEER_RESET, Position(rank=0, store=store), 2, cfg_of(tmp_path), "train", None)
    assert line.startswith("rank 1 (node 0) failed during the generation of rollout 1: --reward: broke;"), line


def test_a_bug_is_one_line_naming_the_stage_and_how_to_see_the_traceback(tmp_path, capsys):
    me = Position(rank=1, node=1, store=DictStore())
    with me.stage("update_weights", 4):
        pass
    line = stop_report(KeyError("w"), me, 2, cfg_of(tmp_path), "train", None)
    assert line.startswith("rank 1 (node 1) failed during the weight sync of rollout 5: KeyError: 'w';")
    assert line.endswith("(FURLONG_DEBUG=1 prints the traceback)")
    assert "Traceback" not in capsys.readouterr().err


def test_debug_env_prints_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FURLONG_DEBUG", "1")
    try:
        raise KeyError("w")
    except KeyError as e:
        stop_report(e, Position(rank=1), 2, cfg_of(tmp_path), "train", None)
    assert "Traceback" in capsys.readouterr().err


def test_without_a_store_the_line_says_what_this_rank_saw(tmp_path):
    me = Position(rank=0, store=DictStore(broken=True))
    line = stop_report(PEER_RESET, me, 2, cfg_of(tmp_path), "train", None)
    assert line.startswith("rank 0 (node 0) lost a peer during set-up (RuntimeError: [gloo/")
    assert "the rendezvous store is unreachable too" in line


def test_restarts_left_are_announced_instead_of_a_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    line = stop_report(PEER_RESET, Position(rank=0, store=DictStore()), 2,
                       cfg_of(tmp_path, "--load", str(tmp_path / "ck")), "train", None)
    assert line.endswith("torchrun restarts the workers (restart 2 of 2), which start over"), line


def test_collective_failures_are_told_from_bugs():
    assert is_collective_failure(PEER_RESET)
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL watchdog timeout"))
    assert not is_collective_failure(KeyError("w")) and not is_collective_failure(RuntimeError("shape"))
    try:   # clean-up raising over the collective's error still counts (the engine's release in a finally)
        try:
            raise PEER_RESET
        finally:
            raise RuntimeError("Engine.release: requests are still running")
    except RuntimeError as e:
        assert is_collective_failure(e)


def test_last_complete_checkpoint_skips_a_damaged_one(tmp_path):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert failure.last_complete_checkpoint(str(tmp_path)) is None
    assert failure.last_complete_checkpoint(None) is None


@pytest.mark.parametrize("argv,needle", [
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes: must be >= 1"),
    (["--use-fault-tolerance"], "--use-fault-tolerance: needs --save"),
    (["--use-fault-tolerance", "--save", "/a", "--load", "/b"], "--use-fault-tolerance: resumes from --save"),
])
def test_new_flags_are_checked(argv, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        parse_config(["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rm-type", "math", *argv])


def test_timeout_and_attempt_store_reach_init_process_group(monkeypatch):
    seen = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed, "_attempt_store", lambda rank, timeout: ("store", rank, timeout))
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                 "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(k, v)
    distributed.init_distributed("cpu", timeout_minutes=3)
    assert seen["timeout"] == datetime.timedelta(minutes=3)
    assert seen["store"] == ("store", 1, datetime.timedelta(minutes=3))


def test_use_fault_tolerance_loads_from_save(tmp_path, monkeypatch):
    from furlong.launch import entry
    got = {}
    monkeypatch.setattr(entry, "_worker", lambda command, cfg, user=None: got.setdefault("load", cfg.ckpt.load) and 0)
    entry.launch("train", cfg_of(tmp_path, "--use-fault-tolerance"))
    assert got["load"] == str(tmp_path / "ck")
