"""`furlong plot`: a small run's metrics.jsonl renders to one PNG; bad inputs are one-line errors."""
from __future__ import annotations

import json

from furlong.cli import main
from furlong.commands.plot import read_metrics


def write_run(d, steps=6, eval_every=3):
    rows = [{"kind": "eval", "step": 0, "eval/gsm8k": 0.2}]
    for s in range(steps):
        r = {"kind": "rollout", "step": s, "rollout/raw_reward": 0.1 * s, "rollout/response_len/mean": 100 + s,
             "rollout/response_len/max": 200 + s, "train/ppo_kl": 1e-3 * s, "train/pg_clipfrac": 0.01 * s,
             "train/entropy": 2.0 - 0.1 * s, "perf/step_time": 5.0, "perf/rollout_time": 3.0,
             "perf/actor_train_time": 1.8}
        if (s + 1) % eval_every == 0:
            r["eval/gsm8k"] = 0.2 + 0.05 * s
        rows.append(r)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_plot_renders_a_png(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    rows, evals = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(6))
    assert [x for x, _ in evals] == [0, 3, 6]                 # before training, after rollouts 3 and 6
    out = tmp_path / "fig" / "m.png"
    assert main(["plot", str(run), "--output", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000   # six drawn panels, not an empty canvas
    from PIL import Image
    with Image.open(out) as im:
        assert im.size[0] > 1000 and im.size[1] > 600
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50        # lines, text and markers, not a blank page
    assert str(out) in capsys.readouterr().out
    assert main(["plot", str(run)]) == 0 and (run / "metrics.png").is_file()


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    assert main(["plot", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "line 2 is not JSON" in err and len(err.strip().splitlines()) == 1
