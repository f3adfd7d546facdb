"""One JSON-lines row -> dict, with the one-line errors every reader of .jsonl files gives."""
from __future__ import annotations

import json
from typing import Any


def json_object(line: str, where: str, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """Parse `line` (a row at `where`, e.g. "f.jsonl: row 3") as a JSON object or raise `error`."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise error(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return rec
