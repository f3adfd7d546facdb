"""Prompt data loading: slices, errors, chat template, ordering, resume."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from furlong.data import DataError, PromptDataset, load_rows, parse_path_spec
from furlong.tasks.synthetic import corpus, make_problems
from furlong.tasks.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    train, _ = make_problems(300, 0, seed=3)
    path = build_tokenizer(corpus(train), tmp_path_factory.mktemp("tok"), vocab_size=400)
    return AutoTokenizer.from_pretrained(path)


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "label": str(2 * i),
             "text": f"plain prompt number {i}"} for i in range(n)]


def _write(tmp_path, rows, ext, name="d"):
    path = tmp_path / f"{name}.{ext}"
    if ext == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("spec,expect", [
    ("", slice(None)), ("@[1:3]", slice(1, 3)), ("@[:2]", slice(None, 2)), ("@[-2:]", slice(-2, None)),
    ("@[2:]", slice(2, None)), ("@[:]", slice(None)), ("@[-4:-1]", slice(-4, -1)), ("@[1:100]", slice(1, 100)),
])
def test_slices(tmp_path, ext, spec, expect):
    path = _write(tmp_path, _rows(6), ext)
    rows = load_rows(f"{path}{spec}", "messages", "label")
    want = list(range(6))[expect]
    assert [r.row for r in rows] == want
    assert [r.label for r in rows] == [str(2 * i) for i in want]
    assert [r.raw[0]["content"] for r in rows] == [f"What is {i} + {i}?" for i in want]


def test_parse_path_spec_keeps_at_signs_in_path():
    assert parse_path_spec("/a@b/c.jsonl") == ("/a@b/c.jsonl", None)
    assert parse_path_spec("/a@b/c.jsonl@[-3:]") == ("/a@b/c.jsonl", slice(-3, None))


def _err(fn, *args, **kw) -> str:
    with pytest.raises(DataError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("suffix", ["@[1:2:3]", "@[a:b]", "@[1]", "@[1:2", "@1:2]x@[", "@[1.5:2]"])
def test_bad_slice_syntax(tmp_path, suffix):
    path = _write(tmp_path, _rows(3), "jsonl")
    msg = _err(load_rows, f"{path}{suffix}", "messages", "label")
    assert str(path) in msg and "slice" in msg


def test_missing_file_and_unknown_extension(tmp_path):
    msg = _err(load_rows, str(tmp_path / "nope.jsonl"), "messages", None)
    assert "nope.jsonl" in msg and "not found" in msg
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    msg = _err(load_rows, str(csv), "a", None)
    assert "d.csv" in msg and ".csv" in msg


def test_malformed_json_row(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in _rows(4)]
    lines[2] = '{"messages": [oops'
    path.write_text("\n".join(lines) + "\n")
    msg = _err(load_rows, str(path), "messages", "label")
    assert str(path) in msg and "row 3" in msg and "JSON" in msg
    # Rows outside the slice are not parsed.
    assert len(load_rows(f"{path}@[:2]", "messages", "label")) == 2


def test_blank_lines_skipped_and_line_reported(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps({"text": "a"}) + "\n\n" + json.dumps({"other": 1}) + "\n")
    msg = _err(load_rows, str(path), "text", None)
    assert "row 2" in msg and "line 4" in msg and "'text'" in msg


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_missing_input_and_label_keys(tmp_path, ext):
    rows = _rows(4)
    path = _write(tmp_path, rows, ext)
    msg = _err(load_rows, str(path), "question", "label")
    assert str(path) in msg and "input key 'question'" in msg and "row 1" in msg
    msg = _err(load_rows, str(path), "messages", "answer")
    assert str(path) in msg and "label key 'answer'" in msg and "row 1" in msg
    # A key missing (null) in one row only: that row is named.
    rows[2] = {"messages": rows[2]["messages"], "label": None, "text": "x"}
    path = _write(tmp_path, rows, ext, name="d2")
    msg = _err(load_rows, str(path), "messages", "label")
    assert str(path) in msg and "row 3" in msg and "label key 'label'" in msg
    rows[1] = {"messages": None, "label": "1", "text": "x"}
    path = _write(tmp_path, rows, ext, name="d3")
    msg = _err(load_rows, str(path), "messages", "label")
    assert "row 2" in msg and "input key 'messages'" in msg


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_empty_data_set(tmp_path, ext):
    path = _write(tmp_path, _rows(3), ext)
    msg = _err(load_rows, f"{path}@[5:]", "messages", None)
    assert str(path) in msg and "empty" in msg
    msg = _err(load_rows, f"{path}@[2:1]", "messages", None)
    assert "empty" in msg
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert "empty" in _err(load_rows, str(empty), "messages", None)


def test_messages_need_the_chat_template_flag(tmp_path, tok):
    path = _write(tmp_path, _rows(3), "parquet")
    msg = _err(PromptDataset, str(path), tok, "messages", "label", apply_chat_template=False)
    assert "--apply-chat-template" in msg and "row 1" in msg and str(path) in msg


def test_bad_messages_value(tmp_path, tok):
    path = _write(tmp_path, [{"messages": [{"role": "user"}], "label": "1"}], "jsonl")
    msg = _err(PromptDataset, str(path), tok, "messages", "label", apply_chat_template=True)
    assert "row 1" in msg and "'messages'" in msg


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_chat_template_applied_and_batch_tokenization_matches_per_row(tmp_path, tok, ext):
    path = _write(tmp_path, _rows(5), ext)
    ds = PromptDataset(f"{path}@[1:]", tok, "messages", "label", apply_chat_template=True)
    assert len(ds) == 4
    for p, i in zip(ds.all(), range(1, 5)):
        msgs = [{"role": "user", "content": f"What is {i} + {i}?"}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert p.text == text and text.endswith("<|im_start|>assistant\n")
        assert p.token_ids == tok.encode(text, add_special_tokens=False)
        assert p.row == i and p.label == str(2 * i) and p.raw == msgs


def test_plain_strings_with_and_without_template(tmp_path, tok):
    path = _write(tmp_path, _rows(3), "jsonl")
    plain = PromptDataset(str(path), tok, "text", "label")
    assert [p.text for p in plain.all()] == [f"plain prompt number {i}" for i in range(3)]
    assert all(p.token_ids == tok.encode(p.text) for p in plain.all())
    wrapped = PromptDataset(str(path), tok, "text", None, apply_chat_template=True)
    for i, p in enumerate(wrapped.all()):
        assert p.text == tok.apply_chat_template([{"role": "user", "content": f"plain prompt number {i}"}],
                                                 tokenize=False, add_generation_prompt=True)
        assert p.label == ""


def test_prompt_too_long_for_context(tmp_path, tok):
    path = _write(tmp_path, _rows(4), "jsonl")
    lengths = [len(p.token_ids) for p in PromptDataset(str(path), tok, "text", None).all()]
    msg = _err(PromptDataset, str(path), tok, "text", None, max_context_len=min(lengths) - 1)
    assert str(path) in msg and "row 1" in msg and str(lengths[0]) in msg and str(min(lengths) - 1) in msg
    assert len(PromptDataset(str(path), tok, "text", None, max_context_len=max(lengths))) == 4


def test_max_prompt_len_drops(tmp_path, tok):
    rows = [{"text": "word " * k} for k in (1, 8, 2, 9, 3)]
    path = _write(tmp_path, rows, "jsonl")
    lengths = [len(p.token_ids) for p in PromptDataset(str(path), tok, "text", None).all()]
    limit = sorted(lengths)[2]
    ds = PromptDataset(str(path), tok, "text", None, max_prompt_len=limit)
    assert ds.num_dropped == sum(n > limit for n in lengths) == 2
    assert [p.row for p in ds.all()] == [i for i, n in enumerate(lengths) if n <= limit]
    # The context check applies to kept prompts only.
    assert len(PromptDataset(str(path), tok, "text", None, max_prompt_len=limit, max_context_len=limit)) == 3
    assert "--rollout-max-prompt-len" in _err(PromptDataset, str(path), tok, "text", None, max_prompt_len=0)


def _ds(path, tok, **kw):
    return PromptDataset(str(path), tok, "text", None, **kw)


def test_order_without_shuffle_and_wraparound(tmp_path, tok):
    path = _write(tmp_path, _rows(5), "jsonl")
    ds = _ds(path, tok)
    assert [p.row for p in ds.next_batch(3)] == [0, 1, 2]
    assert (ds.epoch, ds.position) == (0, 3)
    assert [p.row for p in ds.next_batch(3)] == [3, 4, 0]   # spans the epoch boundary
    assert (ds.epoch, ds.position) == (1, 1)
    assert [p.row for p in ds.next_batch(12)] == [1, 2, 3, 4] + [0, 1, 2, 3, 4] * 1 + [0, 1, 2]
    assert (ds.epoch, ds.position) == (3, 3)
    with pytest.raises(ValueError):
        ds.next_batch(0)


def test_shuffle_is_seeded_and_differs_per_epoch(tmp_path, tok):
    n = 40
    path = _write(tmp_path, _rows(n), "jsonl")
    a, b, c = (_ds(path, tok, shuffle=True, seed=s) for s in (7, 7, 8))
    ea = [[p.row for p in a.next_batch(n)] for _ in range(3)]
    eb = [[p.row for p in b.next_batch(n)] for _ in range(3)]
    ec = [[p.row for p in c.next_batch(n)] for _ in range(3)]
    assert ea == eb
    assert ea != ec
    assert all(sorted(e) == list(range(n)) for e in ea)
    assert ea[0] != ea[1] != ea[2] and ea[0] != list(range(n))
    # Epoch e with seed s is the same permutation as epoch e-1 with seed s+1 (seed + epoch).
    assert ec[0] == ea[1]


def test_state_dict_resume_continues_exactly(tmp_path, tok):
    path = _write(tmp_path, _rows(7), "parquet")
    full = _ds(path, tok, shuffle=True, seed=11)
    want = [[p.row for p in full.next_batch(3)] for _ in range(9)]
    first = _ds(path, tok, shuffle=True, seed=11)
    got = [[p.row for p in first.next_batch(3)] for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))   # as a checkpoint would store it
    resumed = _ds(path, tok, shuffle=True, seed=11)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (first.epoch, first.position)
    got += [[p.row for p in resumed.next_batch(3)] for _ in range(5)]
    assert got == want
    other = _ds(f"{path}@[1:]", tok, shuffle=True, seed=11)
    assert "6" in _err(other.load_state_dict, state)
