"""`furlong prepare` (gsm8k from the sample files, synthetic; gsm8k offline without --input) and
`furlong score`, run in-process through `furlong.cli.main`, and the check of prepare / score /
export's --output before any work. None of them needs a checkpoint."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_cli import assert_one_line, run_cli, write_jsonl  # noqa: E402

from furlong.cli import main  # noqa: E402

GSM8K_SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k"


def test_prepare_gsm8k_counts(tmp_path, capsys):
    src = GSM8K_SAMPLE
    expect = {s: sum(1 for line in open(src / f"{s}.jsonl") if line.strip()) for s in ("train", "test")}
    code, out, _ = run_cli(["prepare", "gsm8k", "--input", str(src), "--output", str(tmp_path)], capsys)
    assert code == 0
    for split, n in expect.items():
        t = pq.read_table(tmp_path / f"{split}.parquet")
        assert t.num_rows == n
        assert {"messages", "label"} <= set(t.column_names)
        assert f"{split} {n} rows" in out
    row = pq.read_table(tmp_path / "train.parquet").slice(0, 1).to_pylist()[0]
    assert row["messages"][0]["role"] == "user" and row["label"] == "72"   # GSM8K train row 1: #### 72


def test_prepare_synthetic(tmp_path, capsys):
    code, out, _ = run_cli(["prepare", "synthetic", "--output", str(tmp_path), "--num-train", "12",
                            "--num-test", "5", "--seed", "3"], capsys)
    assert code == 0
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 12
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 5
    assert "train 12 rows" in out


def test_score_prints_accuracy_and_writes_scores(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [
        json.dumps({"response": "so \\boxed{12}", "label": "12"}),
        json.dumps({"response": "The answer is 7", "label": "8"}),
        json.dumps({"response": "#### 1,000", "label": "1000"}),
        json.dumps({"response": "\\boxed{\\frac{1}{2}}", "label": "0.5"}),
    ])
    out_path = tmp_path / "s.jsonl"
    code, out, _ = run_cli(["score", "--rm-type", "math", "--input", str(src), "--output", str(out_path)], capsys)
    assert code == 0
    assert "3/4" in out and "75.0%" in out
    scores = [json.loads(x)["score"] for x in out_path.read_text().splitlines()]
    assert scores == [1.0, 0.0, 1.0, 1.0]


def test_score_malformed_row_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [json.dumps({"response": "1", "label": "1"}), "{nope"])
    code, _, err = run_cli(["score", "--input", str(src)], capsys)
    assert code == 2
    assert_one_line(err, "r.jsonl", "2")


def test_prepare_gsm8k_without_input_offline_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code, _, err = run_cli(["prepare", "gsm8k", "--output", str(tmp_path / "out")], capsys)
    assert code == 2
    assert_one_line(err, "--input")
    assert not (tmp_path / "out").exists()




@pytest.mark.parametrize("argv", [
    ["prepare", "synthetic", "--output", "{f}/sub"],
    ["score", "--input", "{f}.jsonl", "--output", "{f}/scores.jsonl"],
    ["export", "--load", "{f}.ck", "--output", "{f}/hf", "--hf-checkpoint", "{f}.hf"],
])
def test_output_of_prepare_score_export_checked_first(tmp_path, capsys, argv):
    """--output under a regular file: one line naming --output, exit 2, before any work."""
    f = tmp_path / "afile"
    f.write_text("x")
    assert main([a.format(f=f) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("furlong: error: --output:") and len(err.splitlines()) == 1, err
