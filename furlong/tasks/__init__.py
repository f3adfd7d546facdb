"""Data preparation tasks: GSM8K conversion, the synthetic arithmetic task, the demo tokenizer.

Shared by the tasks: the wording of the user turn (question + the request for a
\\boxed{} final answer, which the math reward reads) and the atomic parquet write.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Our own wording; the math reward only needs the final answer in \boxed{}.
BOXED_INSTRUCTION = "Solve this step by step and write the final number inside \\boxed{}."


def user_turn(question: str) -> list[dict[str, str]]:
    """Chat messages for one prompt: a single user turn asking for a boxed answer."""
    return [{"role": "user", "content": f"{question.strip()}\n{BOXED_INSTRUCTION}"}]


def write_parquet_atomic(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Write `rows` (same keys each) as a parquet file via a temp file + os.replace,
    so a reader never sees a half-written file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
