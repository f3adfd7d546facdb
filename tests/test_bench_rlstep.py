"""The bench's `rlstep` part on the CPU at tiny scale: real RL steps without and with --partial-rollout, side by
side; and its prompt pool on bench/long_workload.json (the workload it is meant for)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from furlong import bench
from furlong.bench.rl_step_part import POOL_PASSES, prompt_pool
from furlong.bench.workload import load_workload
from test_bench import tiny_workload, write

LONG_WORKLOAD = Path(__file__).resolve().parents[1] / "bench" / "long_workload.json"


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_rlstep_runs_both_modes_side_by_side(tmp_path, capsys):
    w = tiny_workload(max_tokens_per_gpu=200)
    # lengths past one decode window (16), so groups finish at different engine steps and some are cut short
    w["rollout"].update(response_lens=[5, 70, 33, 12, 48, 21], max_response_len=70)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, w)), str(out), "rlstep") == 0
    rep = json.loads(out.read_text())["parts"]["rlstep"]
    assert rep["status"] == "ok", rep["error"]
    r = rep["result"]
    k = r["num_steps"]
    assert k == 3 and r["rollout_batch_size"] == 3 and r["over_sampling_batch_size"] == 6
    assert len(r["partial_step_s"]) == k and len(r["plain_step_s"]) == k - 1
    for mode in ("plain", "partial"):
        assert all(t > 0 for t in r[f"{mode}_step_s"])
        assert all(a <= s for a, s in zip(r[f"{mode}_rollout_s"], r[f"{mode}_step_s"]))
        assert all(t > 0 for t in r[f"{mode}_train_s"])
    # partial step 1 pauses what plain would abort; the buffer (at most 6 groups) is drawn whole next step
    assert r["partial_paused_samples"][0] > 0
    assert r["partial_resumed_samples"][1:] == r["partial_paused_samples"][:-1]
    assert r["partial_resumed_samples"][0] == 0 and r["partial_offpolicy_token_frac"][0] == 0
    assert r["plain_resumed_samples"] == [0] * (k - 1)         # plain steps continue nothing
    assert max(r["partial_offpolicy_token_frac"]) > 0
    # plain steps drop the buffer: their unfinished groups are aborted
    assert all(a > 0 for a in r["plain_aborted_groups"])
    after = lambda xs: sum(xs[1:]) / (k - 1)   # noqa: E731
    assert r["plain_step_s_after_first"] == pytest.approx(sum(r["plain_step_s"]) / (k - 1))
    assert r["partial_speedup"] == pytest.approx(r["plain_step_s_after_first"] / after(r["partial_step_s"]))
    printed = capsys.readouterr().out
    assert "rlstep partial step 3" in printed and "rlstep plain step 3" in printed and "partial_speedup" in printed
    assert "rlstep plain step 1" not in printed
    # plain steps resume nothing: the paused buffer was dropped, not carried into them
    plain_lines = [ln for ln in printed.splitlines() if "rlstep plain step" in ln]
    assert len(plain_lines) == k - 1 and all("resumed 0 samples" in ln for ln in plain_lines), plain_lines


def test_rlstep_pool_of_the_long_workload():
    w = load_workload(LONG_WORKLOAD)
    assert (w.rlstep_num_steps, w.rlstep_over_sampling, w.rlstep_zero_std_every) == (2, 64, 4)
    b = SimpleNamespace(w=w, seed=0, args=SimpleNamespace(vocab_size=w.model["vocab_size"]))
    prompts, forced = prompt_pool(b)
    num = len(w.prompt_lens)
    assert len(prompts) == len(forced) == POOL_PASSES * num
    assert [len(p.token_ids) for p in prompts] == w.prompt_lens * POOL_PASSES
    for p in range(POOL_PASSES):   # each pass deals exactly the workload's response lengths
        dealt = [x for q in prompts[p * num:(p + 1) * num] for x in forced[tuple(q.token_ids)]]
        assert Counter(dealt) == Counter(w.response_lens)
    assert [forced[tuple(q.token_ids)] for q in prompts[:num]] == [w.response_lens[i * 8:(i + 1) * 8]
                                                                  for i in range(num)]


def test_rl_step_probe_is_checked(tmp_path):
    w = tiny_workload()
    w["rl_step_probe"] = {"num_steps": 0}
    with pytest.raises(ValueError, match="rl_step_probe"):
        load_workload(write(tmp_path, w))


def test_rlstep_with_offload_weights_releases_the_engine_weights_for_each_train_step(tmp_path, monkeypatch):
    """`furlong bench --parts rlstep --offload-rollout-level kv_cache weight`: the part's engine is built with
    releasable weights and rl_step gives them back for every train step (the comparison that decides
    --offload-rollout-level's default), and the weight update takes them back."""
    from furlong.engine import Engine
    calls = Counter()
    release, restore = Engine.release_weights, Engine.restore_weights

    def counted_release(self):
        calls["release_weights"] += 1
        release(self)

    def counted_restore(self):   # every weight update calls it; count only those that had weights to restore
        calls["restore_weights"] += self.runner.weights_released
        restore(self)
    monkeypatch.setattr(Engine, "release_weights", counted_release)
    monkeypatch.setattr(Engine, "restore_weights", counted_restore)
    w = tiny_workload(max_tokens_per_gpu=200)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, w)), str(out), "rlstep", offload_weights=True) == 0
    rep = json.loads(out.read_text())["parts"]["rlstep"]
    assert rep["status"] == "ok", rep["error"]
    r = rep["result"]
    steps = len(r["partial_step_s"]) + len(r["plain_step_s"])
    assert r["offload_weights"] is True
    assert calls["release_weights"] == steps and calls["restore_weights"] == steps


def test_rlstep_without_offload_weights_keeps_them(tmp_path, monkeypatch):
    """`--offload-rollout-level kv_cache` (not the default): the rlstep part's engine never releases."""
    from furlong.engine import Engine
    calls = []
    monkeypatch.setattr(Engine, "release_weights", lambda self: calls.append("release"))
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, tiny_workload(max_tokens_per_gpu=200))), str(out), "rlstep",
                           offload_weights=False) == 0
    rep = json.loads(out.read_text())["parts"]["rlstep"]
    assert rep["status"] == "ok", rep["error"]
    assert rep["result"]["offload_weights"] is False and calls == []
