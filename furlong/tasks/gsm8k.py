"""GSM8K jsonl -> parquet prompt data (`furlong prepare gsm8k`).

Input: DIR/{train,test}.jsonl with `question` and `answer` per line (the
original release). Without --input, the data set is fetched with the `datasets`
library (`openai/gsm8k`, config `main`) into a temporary folder of the same
jsonl files; when the package or the hub is unavailable that is a one-line
error asking for --input. Output: DIR/{train,test}.parquet with `messages` (one user
turn: the question plus a request for the final answer in \\boxed{}) and
`label` (the number after the answer's "####", thousands commas removed).
"""
from __future__ import annotations

from pathlib import Path

from furlong.jsonl import json_object
from furlong.tasks import user_turn, write_parquet_atomic

SPLITS = ("train", "test")


def gsm8k_label(answer: str) -> str:
    """The final number of a GSM8K answer: the text after the last '####', commas removed."""
    if "####" not in answer:
        raise ValueError("no '####' final-answer marker")
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not label:
        raise ValueError("empty answer after '####'")
    return label


def _convert_split(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            rec = json_object(line, where)
            for key in ("question", "answer"):
                if not isinstance(rec.get(key), str):
                    raise ValueError(f"{where}: missing or non-string key {key!r}")
            try:
                label = gsm8k_label(rec["answer"])
            except ValueError as e:
                raise ValueError(f"{where}: key 'answer': {e}") from None
            rows.append({"messages": user_turn(rec["question"]), "label": label})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def download_gsm8k(dest: Path) -> Path:
    """DEST/{train,test}.jsonl from the hub through `datasets`; ValueError naming --input otherwise."""
    import json
    try:
        from datasets import load_dataset
    except ImportError:
        raise ValueError("--input: not given, and the `datasets` package is not installed to download GSM8K; "
                         "pass --input DIR holding train.jsonl and test.jsonl, or install it: "
                         "pip install 'furlong[gsm8k]'") from None
    try:
        data = load_dataset("openai/gsm8k", "main")
    except Exception as e:   # offline, hub errors, ...: all mean "give the files yourself"
        why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        raise ValueError(f"--input: not given, and GSM8K could not be downloaded ({why}); pass --input DIR "
                         "holding train.jsonl and test.jsonl") from None
    dest.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        with open(dest / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in data[split]:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    return dest


def prepare_gsm8k(input_dir: str | Path | None, output_dir: str | Path) -> dict[str, int]:
    """Convert both splits; return rows written per split. Both are read before either is written."""
    if input_dir is None:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            return prepare_gsm8k(download_gsm8k(Path(tmp)), output_dir)
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    converted = {split: _convert_split(input_dir / f"{split}.jsonl") for split in SPLITS}
    for split, rows in converted.items():
        write_parquet_atomic(rows, output_dir / f"{split}.parquet")
    return {split: len(rows) for split, rows in converted.items()}
