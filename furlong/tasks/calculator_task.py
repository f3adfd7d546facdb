"""The synthetic task with a calculator: the word problems of synthetic.py with numbers too large to
work out in the head (operands up to `digits` digits: 5 by default, so products of 9-10 digits), and
the calculator tool's spec on every row, for the multi-turn tool recipe
(tools/calculator_generate.py).

Files written: train.parquet, test.parquet with columns messages (the user turn), label, answer and
tools (a JSON string of [calculator.SPEC]: pass `--tool-key tools` (the default) and
`--apply-chat-template`, and the chat template renders the tool for the model).
"""
from __future__ import annotations

import json
from pathlib import Path

from furlong.tasks import write_parquet_atomic
from furlong.tasks.synthetic import make_problems, prompt_row
from furlong.tools.calculator import SPEC


def prepare_calculator_task(output_dir: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                            digits: int = 5, two_step_fraction: float = 0.25) -> dict[str, int]:
    """Write train/test parquet files to `output_dir`; return rows per file."""
    if not 2 <= digits <= 12:
        raise ValueError(f"digits: must be in [2, 12], got {digits}")
    largest = 10 ** digits - 1
    train, test = make_problems(num_train, num_test, seed, max_number=largest, max_factor=largest,
                                two_step_fraction=two_step_fraction)
    if not train or not test:
        raise ValueError(f"num_train/num_test: both must be >= 1, got {num_train}/{num_test}")
    tools = json.dumps([SPEC])
    out = Path(output_dir)
    write_parquet_atomic([{**prompt_row(p), "tools": tools} for p in train], out / "train.parquet")
    write_parquet_atomic([{**prompt_row(p), "tools": tools} for p in test], out / "test.parquet")
    return {"train": len(train), "test": len(test)}
