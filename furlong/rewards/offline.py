"""Offline scoring for `furlong score`: grade a .jsonl of responses against labels.

Each non-blank line is a JSON object with a response and a label (keys chosen by
the caller). The per-row scores go to `<input stem>.scores.jsonl` (or
`output_path`), one `{"row", "label", "score"}` object per scored row, written
to a temporary file and renamed so a crash never leaves a half-written file.
Rows are numbered from 1 by line, blank lines included, so messages match an
editor's line numbers.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from furlong.jsonl import json_object
from furlong.rewards.registry import get_scorer


@dataclass
class ScoreReport:
    num_rows: int        # rows scored
    num_correct: int     # rows with score >= 1: the correct ones (rewards are 1 when correct)
    accuracy: float      # num_correct / num_rows (not the mean score: dapo scores wrong rows -1)
    output_path: str     # where the per-row scores were written
    mean_score: float    # mean score over the rows


def default_output_path(input_path: str | os.PathLike) -> Path:
    p = Path(input_path)
    return p.with_name((p.stem if p.suffix == ".jsonl" else p.name) + ".scores.jsonl")


def _field(row: dict, key: str, where: str) -> str:
    if key not in row or row[key] is None:
        raise ValueError(f"{where}: missing key {key!r}")
    value = row[key]
    return value if isinstance(value, str) else json.dumps(value)


def run_score(input_path: str | os.PathLike, rm_type: str, response_key: str = "response",
              label_key: str = "label", output_path: str | os.PathLike | None = None,
              overwrite: bool = False) -> ScoreReport:
    """Score every row of `input_path` with the built-in reward `rm_type`. The output file must not
    exist (unless `overwrite`) nor be the input; a symlink's target is written, the link kept."""
    from furlong.safe_paths import check_file_target
    scorer = get_scorer(rm_type)
    src = Path(input_path)
    dst = Path(output_path) if output_path is not None else default_output_path(src)
    dst = check_file_target(dst, "--output", {"--input": src}, overwrite)
    try:
        lines = src.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: cannot read ({e})") from e
    out_rows, total = [], 0.0
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{src} row {n}"
        row = json_object(line, where)
        response = _field(row, response_key, where)
        label = _field(row, label_key, where)
        value = float(scorer(response, label))
        total += value
        out_rows.append({"row": n, "label": label, "score": value})
    if not out_rows:
        raise ValueError(f"{src}: no rows to score")
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in out_rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    num_correct = sum(1 for r in out_rows if r["score"] >= 1.0)
    return ScoreReport(num_rows=len(out_rows), num_correct=num_correct,
                       accuracy=num_correct / len(out_rows), output_path=str(dst),
                       mean_score=total / len(out_rows))
