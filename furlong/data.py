"""Prompt data sets: .parquet/.jsonl rows -> tokenized `Prompt`s, served in epochs.

A path spec is `FILE` or `FILE@[a:b]`: the rows FILE[a:b] with Python slice
semantics (a, b optional, may be negative). Every row is rendered and
tokenized once, up front, with the tokenizer's batch calls (GSM8K's 7473 rows
take about a second). Chat messages go through the tokenizer's chat template
(with the generation prompt) under --apply-chat-template; a plain string is
then wrapped as one user turn, and used verbatim without the flag.

Tokenization: template-rendered text already carries its special tokens, so it
is encoded with add_special_tokens=False; a plain string without the template
gets the tokenizer's usual specials (e.g. a Llama BOS), as `generate` would.

Order: epoch e visits the prompts in file order, or, with shuffle, in a
permutation drawn from random.Random(seed + e). A batch may span the boundary
between epochs. `state_dict` records (epoch, position), which is all that is
needed to continue the exact same order after a resume.

Every bad input raises DataError (a ValueError) with one line naming the file,
the 1-based row and the key where they apply.
"""
from __future__ import annotations

import random
import re
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.jsonl import json_object
from furlong.types import Prompt


class DataError(ValueError):
    """Bad prompt data or data flags; the message is one line naming file/row/key."""


@dataclass
class RawRow:
    row: int      # 0-based row index in the source file (before slicing: FILE@[5:] starts at 5)
    raw: Any      # the input-key value: chat messages (list of dicts) or a string
    label: str    # the label-key value as a string ("" without a label key)
    extras: dict[str, Any] = field(default_factory=dict)   # the optional columns (tools, metadata) the row has


_ABSENT = object()   # a jsonl row without the key (None is a JSON null)
_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<a>[+-]?\d*):(?P<b>[+-]?\d*)\]$")


def parse_path_spec(path_spec: str) -> tuple[str, slice | None]:
    """Split `FILE@[a:b]` into (FILE, slice(a, b)); a spec without '@[' has no slice."""
    if "@[" not in path_spec:
        return path_spec, None
    m = _SLICE.match(path_spec)
    if m is None:
        raise DataError(f"{path_spec}: bad row slice; expected FILE@[a:b] with optional integers a, b")
    a, b = m["a"], m["b"]
    return m["path"], slice(int(a) if a else None, int(b) if b else None)


def _read_jsonl(path: Path, rows: slice, input_key: str, label_key: str | None, extra_keys: tuple[str, ...] = ()
                ) -> list[tuple[int, str, Any, Any, dict]]:
    """(row index, location text, input value, label value, optional columns present) of the selected rows;
    only those are parsed."""
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    lines = []
    for no, b in enumerate(raw_lines, start=1):
        try:
            line = b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {no}: not UTF-8 text (byte {b[e.start]:#04x} at column {e.start + 1})") \
                from None
        if line.strip():
            lines.append((no, line))
    out = []
    for index in range(len(lines))[rows]:
        line_no, line = lines[index]
        where = f"{path}: row {index + 1}" + (f" (line {line_no})" if line_no != index + 1 else "")
        rec = json_object(line, where, DataError)
        out.append((index, where, rec.get(input_key, _ABSENT), rec.get(label_key, _ABSENT) if label_key else None,
                    {k: rec[k] for k in extra_keys if rec.get(k) is not None}))
    return out


def _read_parquet(path: Path, rows: slice, input_key: str, label_key: str | None, extra_keys: tuple[str, ...] = ()
                  ) -> list[tuple[int, str, Any, Any, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    columns = pf.schema_arrow.names
    for kind, key in (("input", input_key), ("label", label_key)):
        if key is not None and key not in columns:
            raise DataError(f"{path}: row 1: missing {kind} key {key!r} (columns: {', '.join(columns)})")
    wanted = [input_key] + ([label_key] if label_key and label_key != input_key else [])
    extra = [k for k in extra_keys if k in columns and k not in wanted]
    wanted += extra
    indices = range(pf.metadata.num_rows)[rows]
    if len(indices) == 0:
        return []
    table = pf.read(columns=wanted)
    # A contiguous slice for a step of 1 (the only step a spec can give).
    table = table.slice(indices.start, len(indices))
    inputs = table.column(input_key).to_pylist()
    labels = table.column(label_key).to_pylist() if label_key else [None] * len(inputs)
    extras = [{k: v for k in extra if (v := table.column(k)[j].as_py()) is not None} for j in range(len(inputs))]
    return [(i, f"{path}: row {i + 1}", x, y, e) for i, x, y, e in zip(indices, inputs, labels, extras)]


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def load_rows(path_spec: str, input_key: str, label_key: str | None, extra_keys: tuple[str, ...] = ()
              ) -> list[RawRow]:
    """Read the rows selected by `path_spec`, checking that each has the input (and label) key;
    `extra_keys` are optional columns kept in RawRow.extras where a row has them."""
    path_str, rows = parse_path_spec(path_spec)
    path = Path(path_str)
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a .jsonl or .parquet file")
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown extension {path.suffix!r} (expected {' or '.join(_READERS)})")
    raw = reader(path, rows if rows is not None else slice(None), input_key, label_key, extra_keys)
    if not raw:
        raise DataError(f"{path_spec}: empty data set (no rows selected)")
    out = []
    for index, where, value, label, extras in raw:
        for kind, key, v in (("input", input_key, value), ("label", label_key, label)):
            if key is not None and v is _ABSENT:
                raise DataError(f"{where}: missing {kind} key {key!r}")
            if key is not None and v is None:
                raise DataError(f"{where}: {kind} key {key!r} is null")
        out.append(RawRow(row=index, raw=value, label="" if label is None else str(label), extras=extras))
    return out


def _json_value(value: Any, kind: type, where: str, flag_name: str, key: str) -> Any:
    """A column value that is `kind` or a JSON string of one (parquet often stores them as strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: key {key!r} ({flag_name}): not valid JSON") from None
    if not isinstance(value, kind):
        raise DataError(f"{where}: key {key!r} ({flag_name}): expected a {kind.__name__}, got {type(value).__name__}")
    return value


def row_metadata(r: RawRow, where: str, tool_key: str | None, metadata_key: str | None) -> dict[str, Any]:
    """The row's --metadata-key dict, with its --tool-key specs under "tools" (as miles)."""
    meta = dict(_json_value(r.extras[metadata_key], dict, where, "--metadata-key", metadata_key)) \
        if metadata_key in r.extras else {}
    if tool_key in r.extras:
        meta["tools"] = _json_value(r.extras[tool_key], list, where, "--tool-key", tool_key)
    return meta


def _check_messages(value: Any, where: str, input_key: str) -> None:
    ok = isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{where}: key {input_key!r}: expected a string or a list of "
                        f"{{'role', 'content'}} messages, got {type(value).__name__}")


class PromptDataset:
    """Tokenized prompts of one data file, served in (optionally shuffled) epochs."""

    def __init__(self, path_spec: str, tokenizer: Any, input_key: str = "input", label_key: str | None = None,
                 apply_chat_template: bool = False, shuffle: bool = False, seed: int = 42,
                 max_prompt_len: int | None = None, max_context_len: int | None = None,
                 tool_key: str | None = None, metadata_key: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.path_spec = path_spec
        self.shuffle = shuffle
        self.seed = seed
        path = parse_path_spec(path_spec)[0]
        rows = load_rows(path_spec, input_key, label_key, tuple(k for k in (tool_key, metadata_key) if k))
        metas = [row_metadata(r, f"{path}: row {r.row + 1}", tool_key, metadata_key) for r in rows]

        conversations, texts = [], []
        for r in rows:
            where = f"{path}: row {r.row + 1}"
            if isinstance(r.raw, str):
                conversations.append([{"role": "user", "content": r.raw}])
                texts.append(r.raw)
                continue
            _check_messages(r.raw, where, input_key)
            if not apply_chat_template:
                raise DataError(f"{where}: key {input_key!r} holds chat messages; pass --apply-chat-template")
            conversations.append(r.raw)
        if apply_chat_template:
            if getattr(tokenizer, "chat_template", None) is None:
                raise DataError("--apply-chat-template: the tokenizer has no chat template")
            kwargs = chat_template_kwargs or {}
            if any("tools" in m for m in metas):   # tools differ per row: one call each
                texts = [tokenizer.apply_chat_template(c, tools=m.get("tools"), tokenize=False,
                                                       add_generation_prompt=True, **kwargs)
                         for c, m in zip(conversations, metas)]
            else:
                texts = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
        token_ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]

        self.num_dropped = 0  # prompts over --rollout-max-prompt-len
        self.prompts: list[Prompt] = []
        for r, text, ids, meta in zip(rows, texts, token_ids, metas):
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                self.num_dropped += 1
                continue
            if max_context_len is not None and len(ids) > max_context_len:
                raise DataError(f"{path}: row {r.row + 1}: prompt is {len(ids)} tokens, over the {max_context_len} "
                                f"the model's context leaves after --rollout-max-response-len")
            self.prompts.append(Prompt(row=r.row, raw=r.raw, text=text, token_ids=list(ids), label=r.label,
                                       metadata=meta))
        if not self.prompts:
            raise DataError(f"{path_spec}: all {len(rows)} prompts are longer than "
                            f"--rollout-max-prompt-len {max_prompt_len}")
        self.epoch = 0      # epochs completed
        self.position = 0   # prompts of the current epoch already served
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.prompts)

    def all(self) -> list[Prompt]:
        """Every prompt in file order (for eval)."""
        return list(self.prompts)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, num: int) -> list[Prompt]:
        """The next `num` prompts, continuing into the next epoch when this one runs out."""
        if num < 1:
            raise ValueError(f"next_batch: num must be >= 1, got {num}")
        out: list[Prompt] = []
        while len(out) < num:
            order = self._epoch_order()
            take = min(num - len(out), len(order) - self.position)
            out.extend(self.prompts[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise DataError(f"{self.path_spec}: resume: checkpoint's data sampler saw {state['num_prompts']} "
                            f"prompts, this data set has {len(self.prompts)}")
        if not 0 <= state["position"] < len(self.prompts) or state["epoch"] < 0:
            raise DataError(f"{self.path_spec}: resume: bad sampler state {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
