"""Checkpoints: exact resume, crash safety of a half-written save, HF export (docs/design.md §8)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401 (tiny_ckpt: fixture)

from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.config_map import actor_config  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.checkpoint.store import (SLEEP_ENV, TRACKER, latest_iteration, load_checkpoint,  # noqa: E402
                                      save_checkpoint)
from furlong.launch.distributed import init_distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rollout_samples(rollout_id: int):
    g = torch.Generator().manual_seed(100 + rollout_id)
    return synthetic_samples([int(x) for x in torch.randint(6, 20, (4,), generator=g)], seed=rollout_id)


def _config(ckpt):
    # two optimizer steps per rollout and a decaying LR: Adam moments and the
    # scheduler position both matter for an exact resume
    return tiny_config(global_batch_size=2, lr=1e-2, lr_decay_style="cosine", lr_warmup_iters=1,
                       micro_batch_size=2, hf_checkpoint=str(ckpt))


def make_actor(ckpt) -> Actor:
    return Actor(load_pretrained(ckpt), actor_config(_config(ckpt)), init_distributed("cpu"))


def train(actor: Actor, rollout_id: int):
    """One rollout's training (old log-probs first: two optimizer steps), as the loop runs it."""
    return train_rollout(actor, _config("unused"), rollout_samples(rollout_id))


def _draws():
    return torch.rand(3), random.random(), float(np.random.rand())


def test_resume_matches_uninterrupted_run(tiny_ckpt, tmp_path):
    save_dir = tmp_path / "save"
    a = make_actor(tiny_ckpt)
    train(a, 0)
    train(a, 1)
    save_checkpoint(save_dir, a, rollout_id=1, sampler_state={"epoch": 3, "offset": 17})
    draws_a = _draws()
    m_a = train(a, 2)
    w_a = full_weights(a)

    assert latest_iteration(save_dir) == 2
    assert (save_dir / "iter_0000002").is_dir() and not (save_dir / "iter_0000002.tmp").exists()
    assert (save_dir / TRACKER).read_text() == "2"

    b = make_actor(tiny_ckpt)
    state = load_checkpoint(save_dir, b)
    assert state.rollout_id == 1 and state.next_rollout_id == 2
    assert state.sampler_state == {"epoch": 3, "offset": 17}
    draws_b = _draws()
    torch.testing.assert_close(draws_b[0], draws_a[0])
    assert draws_b[1:] == draws_a[1:]
    assert b.scheduler.last_epoch == 4
    m_b = train(b, 2)
    for field in ("loss", "pg_loss", "ppo_kl", "entropy", "grad_norm", "lr"):
        assert getattr(m_b, field) == getattr(m_a, field), field
    for n, w in full_weights(b).items():
        torch.testing.assert_close(w, w_a[n], rtol=0, atol=0, msg=n)


def test_load_without_checkpoint_returns_none(tiny_ckpt, tmp_path):
    assert load_checkpoint(tmp_path, make_actor(tiny_ckpt)) is None
    (tmp_path / TRACKER).write_text("junk")
    with pytest.raises(ValueError, match="--load"):
        latest_iteration(tmp_path)


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from furlong.launch.distributed import launch_local

    def work(ckpt, save_dir):
        import torch
        from test_checkpoint import make_actor, train
        from test_actor import full_weights
        from furlong.checkpoint.store import save_checkpoint, SLEEP_ENV
        a = make_actor(ckpt)
        train(a, 0)
        save_checkpoint(save_dir, a, rollout_id=0, sampler_state={{"epoch": 1}})
        w = full_weights(a)
        if torch.distributed.get_rank() == 0:
            torch.save(w, os.path.join(save_dir, "weights_at_0.pt"))
        train(a, 1)
        os.environ[SLEEP_ENV] = "600"   # the second save hangs after writing its shards
        save_checkpoint(save_dir, a, rollout_id=1, sampler_state={{"epoch": 2}})

    if __name__ == "__main__":
        launch_local(work, 2, sys.argv[1], sys.argv[2])
""")


def test_killed_save_leaves_previous_checkpoint(tiny_ckpt, tmp_path):
    """Two ranks save after rollout 0, then are SIGKILLed mid-way through the save after
    rollout 1: the tracker still names iter_0000001, which loads (here at world size 1)
    with the weights it was saved with; the next save replaces the stale temp dir."""
    save_dir = tmp_path / "save"
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT.format(tests=str(REPO / "tests")))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_ckpt), str(save_dir)], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marker = save_dir / "iter_0000002.tmp" / "trainer.pt"
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "save never reached its mid-point"
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    assert latest_iteration(save_dir) == 1
    assert (save_dir / "iter_0000002.tmp").is_dir() and not (save_dir / "iter_0000002").exists()
    actor = make_actor(tiny_ckpt)
    state = load_checkpoint(save_dir, actor)
    assert state.rollout_id == 0 and state.sampler_state == {"epoch": 1}
    want = torch.load(save_dir / "weights_at_0.pt")
    for n, w in full_weights(actor).items():
        torch.testing.assert_close(w, want[n], rtol=0, atol=0, msg=n)
    assert os.environ.get(SLEEP_ENV) is None
    save_checkpoint(save_dir, actor, rollout_id=1)
    assert latest_iteration(save_dir) == 2 and not (save_dir / "iter_0000002.tmp").exists()


def test_export_hf_loads_in_transformers(tiny_ckpt, tmp_path):
    """Train, save, export; transformers' logits on the export equal our trained model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.commands.export import export_hf

    a = make_actor(tiny_ckpt)
    train(a, 0)
    save_checkpoint(tmp_path / "save", a, rollout_id=0, source=str(tiny_ckpt))
    out = export_hf(tmp_path / "save", tmp_path / "hf")   # source checkpoint recorded in the save
    trained = load_pretrained(tiny_ckpt)
    trained.load_state_dict(full_weights(a))
    original = load_pretrained(tiny_ckpt)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids)
        got = hf(ids).logits
        assert not torch.allclose(original(ids), want)   # training changed the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out).decode([40, 41]) == AutoTokenizer.from_pretrained(tiny_ckpt).decode([40, 41])


def test_eval_load_generates_with_the_chosen_iteration(tiny_ckpt, tmp_path, capsys):
    """`furlong eval --load DIR --ckpt-step N` generates with iteration N's weights: greedy responses equal
    those of N's HF export and differ from the untrained --hf-checkpoint's."""
    import json

    from furlong.cli import main
    from furlong.commands.export import export_hf
    from furlong.tasks.synthetic import prepare_synthetic

    a = make_actor(tiny_ckpt)
    train(a, 0)
    save_checkpoint(tmp_path / "save", a, rollout_id=0, source=str(tiny_ckpt))
    train(a, 1)
    save_checkpoint(tmp_path / "save", a, rollout_id=1, source=str(tiny_ckpt))     # the latest; --ckpt-step 1 must not load it
    export_hf(tmp_path / "save", tmp_path / "hf1", ckpt_step=1)
    prepare_synthetic(tmp_path / "data", 2, 4, 0)

    def responses(name: str, ckpt: Path, *extra: str) -> list[str]:
        assert main(["eval", "--hf-checkpoint", str(ckpt), "--eval-prompt-data", "t",
                     str(tmp_path / "data" / "test.parquet"), "--input-key", "messages", "--label-key", "label",
                     "--apply-chat-template", "--rm-type", "math", "--rollout-max-response-len", "8",
                     "--eval-temperature", "0", "--device", "cpu", "--output-dir", str(tmp_path / name), *extra]) == 0
        rows = next((tmp_path / name / "samples").glob("eval_t_*.jsonl")).read_text().splitlines()
        return [json.loads(r)["response"] for r in rows]

    loaded = responses("loaded", tiny_ckpt, "--load", str(tmp_path / "save"), "--ckpt-step", "1")
    assert "evaluating iteration 1 of" in capsys.readouterr().out
    assert loaded == responses("exported", tmp_path / "hf1")
    assert loaded != responses("base", tiny_ckpt)
