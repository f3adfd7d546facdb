"""Data preparation: GSM8K conversion, the synthetic task, the demo tokenizer."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from furlong.tasks import BOXED_INSTRUCTION
from furlong.tasks.gsm8k import prepare_gsm8k
from furlong.tasks.synthetic import corpus, make_problems, prepare_synthetic, sft_rows
from furlong.tasks.tokenizer import build_tokenizer

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"   # a sample shipped with the tests


def test_prepare_gsm8k_real(tmp_path):
    counts = prepare_gsm8k(GSM8K, tmp_path)
    assert counts == {"train": 301, "test": 150}   # the shipped sample (tests/data/gsm8k/README.md)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]  # no temp files left
    for split, n in counts.items():
        table = pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        src = [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        assert len(table) == len(src) == n
        for row, rec in zip(table, src):
            final = rec["answer"].splitlines()[-1]
            assert final.startswith("#### ")
            assert row["label"] == final[5:].replace(",", "").strip()
            assert re.fullmatch(r"-?\d+(\.\d+)?", row["label"]), row["label"]
            (msg,) = row["messages"]
            assert msg["role"] == "user"
            assert msg["content"].startswith(rec["question"].strip()) and "\\boxed{}" in msg["content"]
    # Spot-check known rows: 72 (train 1); a thousands-comma label exists and lost its comma.
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert train[0]["label"] == "72"
    assert any("," in json.loads(line)["answer"].rsplit("####", 1)[1]
               for line in (GSM8K / "train.jsonl").read_text().splitlines())


def _gsm_dir(tmp_path, train_lines, test_lines=None):
    d = tmp_path / "in"
    d.mkdir()
    ok = json.dumps({"question": "q?", "answer": "x\n#### 1,234"})
    (d / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    (d / "test.jsonl").write_text("\n".join(test_lines or [ok]) + "\n")
    return d


def test_prepare_gsm8k_small_and_errors(tmp_path):
    ok = json.dumps({"question": "What?", "answer": "steps\n#### 1,234"})
    d = _gsm_dir(tmp_path, [ok, ok])
    assert prepare_gsm8k(d, tmp_path / "out") == {"train": 2, "test": 1}
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert rows[0] == {"messages": [{"role": "user", "content": f"What?\n{BOXED_INSTRUCTION}"}], "label": "1234"}

    cases = [
        ([ok, "{not json"], "line 2"),
        ([ok, ok, json.dumps({"question": "q"})], "line 3"),
        ([json.dumps({"question": "q", "answer": "no marker"})], "line 1"),
    ]
    for i, (lines, where) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "train.jsonl").write_text("\n".join(lines) + "\n")
        (d / "test.jsonl").write_text(ok + "\n")
        with pytest.raises(ValueError) as ei:
            prepare_gsm8k(d, tmp_path / f"o{i}")
        msg = str(ei.value)
        assert "train.jsonl" in msg and where in msg and "\n" not in msg
        assert not (tmp_path / f"o{i}" / "test.parquet").exists()   # nothing written on error
    (d := tmp_path / "in" / "test.jsonl").unlink()
    with pytest.raises(ValueError, match="test.jsonl: file not found"):
        prepare_gsm8k(d.parent, tmp_path / "o")


def test_synthetic_deterministic_and_disjoint():
    a_train, a_test = make_problems(800, 200, seed=5)
    b_train, b_test = make_problems(800, 200, seed=5)
    c_train, _ = make_problems(800, 200, seed=6)
    assert (a_train, a_test) == (b_train, b_test)
    assert a_train != c_train
    assert len(a_train) == 800 and len(a_test) == 200
    train_q = {p.question for p in a_train}
    assert len(train_q) == 800
    assert not train_q & {p.question for p in a_test}
    # Variety: several templates, names, objects and all three operators.
    assert len({re.sub(r"\d+", "#", p.question.split(" ", 1)[1]) for p in a_train}) > 30
    assert {op for p in a_train for op in "+-*" if f" {op} " in p.expression} == {"+", "-", "*"}


def test_synthetic_labels_are_correct():
    train, test = make_problems(600, 100, seed=1, max_number=30, max_factor=6, two_step_fraction=0.5)
    num_two_step = 0
    for p in train + test:
        value = eval(p.expression)  # noqa: S307 - our own "a op b [op c]" strings
        # The expression means left to right; recompute that way, independent of Python's precedence.
        tokens = p.expression.split()
        acc = int(tokens[0])
        for op, v in zip(tokens[1::2], tokens[2::2]):
            acc = {"+": acc + int(v), "-": acc - int(v), "*": acc * int(v)}[op]
        assert p.label == str(acc) and acc >= 0
        if "*" not in tokens[3:]:          # only a trailing * would differ from left-to-right
            assert value == acc
        # The question holds exactly the expression's numbers, in order.
        assert re.findall(r"\d+", p.question) == re.findall(r"\d+", p.expression)
        # Each worked step is right, and the solution ends with the boxed label.
        for x, op, y, z in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)\.", p.solution):
            assert eval(f"{x} {op} {y}") == int(z)
        assert p.solution.endswith(f"\\boxed{{{p.label}}}")
        assert p.answer == f"{p.solution}\n#### {p.label}"
        num_two_step += len(tokens) == 5
    assert 0.35 < num_two_step / 700 < 0.65


def test_synthetic_limits():
    with pytest.raises(ValueError, match="distinct"):
        make_problems(10000, 5000, seed=0, max_number=1, max_factor=2, two_step_fraction=0.0)
    with pytest.raises(ValueError, match="two_step_fraction"):
        make_problems(1, 1, two_step_fraction=2.0)


def test_prepare_synthetic_files(tmp_path):
    counts = prepare_synthetic(tmp_path, num_train=50, num_test=20, seed=2)
    assert counts == {"train": 50, "test": 20, "sft": 50}
    train, test = make_problems(50, 20, seed=2)
    got_train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    got_test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    sft = pq.read_table(tmp_path / "sft.parquet").to_pylist()
    assert [r["label"] for r in got_train] == [p.label for p in train]
    assert [r["messages"][0]["content"] for r in got_test] == [f"{p.question}\n{BOXED_INSTRUCTION}" for p in test]
    assert all(len(r["messages"]) == 1 and r["answer"].endswith("#### " + r["label"]) for r in got_train)
    assert sft == sft_rows(train)
    for r, p in zip(sft, train):
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"] == p.solution


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    train, _ = make_problems(400, 0, seed=0)
    out = tmp_path_factory.mktemp("tok")
    path = build_tokenizer(corpus(train), out, vocab_size=384)
    assert Path(path) == out
    return AutoTokenizer.from_pretrained(path)


def test_tokenizer_round_trip(tiny_tok):
    train, _ = make_problems(50, 0, seed=9)
    rng = random.Random(0)
    printable = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    texts = corpus(train) + ["", " ", "  leading and trailing  ", "a\n\nb\t c", "x" * 300, "0123456789 -42 3.5"]
    texts += ["".join(rng.choice(printable) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    for t in texts:
        ids = tiny_tok.encode(t, add_special_tokens=False)
        assert tiny_tok.decode(ids) == t
    assert len(tiny_tok) == 384


def test_tokenizer_digits_and_specials(tiny_tok):
    ids = tiny_tok.encode("Tom has 1234 apples and 56 more.", add_special_tokens=False)
    pieces = [tiny_tok.decode([i]) for i in ids]
    assert all(len(p.strip()) == 1 for p in pieces if any(c.isdigit() for c in p))
    assert [p for p in pieces if p.isdigit()] == ["1", "2", "3", "4", "5", "6"]
    # Frequent corpus words were merged (it is a BPE, not a byte tokenizer).
    assert len(ids) < len("Tom has 1234 apples and 56 more.")
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tiny_tok.encode(s, add_special_tokens=False)) == 1
    assert tiny_tok.eos_token == "<|im_end|>" and tiny_tok.pad_token == "<|endoftext|>"
    assert tiny_tok.pad_token_id != tiny_tok.eos_token_id
    assert tiny_tok.encode("hi") == tiny_tok.encode("hi", add_special_tokens=False)   # no BOS added


def test_tokenizer_chat_template(tiny_tok):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5. \\boxed{5}"}]
    full = tiny_tok.apply_chat_template(msgs, tokenize=False)
    assert full == ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n2 + 3 = 5. \\boxed{5}<|im_end|>\n")
    gen = tiny_tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert full.startswith(gen)
    ids = tiny_tok.encode(full, add_special_tokens=False)
    assert tiny_tok.decode(ids) == full
    assert ids.count(tiny_tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_tokenizer_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["abc"], tmp_path, vocab_size=100)


def test_sft_rows_unboxed_fraction_mixes_styles_the_reward_reads_or_not():
    from furlong.rewards import score
    train, _ = make_problems(400, 0, seed=3)
    rows = sft_rows(train, unboxed_fraction=0.5, seed=3)
    assert rows == sft_rows(train, unboxed_fraction=0.5, seed=3)      # seeded
    texts = [r["messages"][-1]["content"] for r in rows]
    boxed = [t for t in texts if "\\boxed{" in t]
    assert 150 < len(boxed) < 250
    for r, t in zip(rows, texts):
        assert score("math", t, r["label"]) == (1.0 if "\\boxed{" in t else 0.0)
        assert t.endswith(f"\\boxed{{{r['label']}}}") or t.endswith(f"So the result is {r['label']}.")
    assert sft_rows(train) == sft_rows(train, unboxed_fraction=0.0)


def test_sft_rows_direct_fraction_skips_the_steps_but_keeps_the_answer():
    from furlong.rewards import score
    train, _ = make_problems(400, 0, seed=4, two_step_fraction=0.5)
    rows = sft_rows(train, seed=4, direct_fraction=0.5)
    texts = [r["messages"][-1]["content"] for r in rows]
    direct = [t for t, p in zip(texts, train) if t == f"\\boxed{{{p.label}}}"]
    assert 150 < len(direct) < 250
    assert all(t == p.solution for t, p in zip(texts, train) if t not in direct)
    assert all(score("math", t, r["label"]) == 1.0 for t, r in zip(texts, rows))
    assert sft_rows(train, seed=4) == sft_rows(train, seed=4, direct_fraction=0.0)


def test_sft_rows_early_stop_fraction_cuts_two_step_solutions_after_step_one():
    """The GPU demo's teacher: a seeded share of the two-step solutions stops after the first step and
    boxes its result (wrong by the reward, same format); one-step solutions are never touched."""
    from furlong.rewards import score
    train, _ = make_problems(600, 0, seed=5, max_number=50, max_factor=9, two_step_fraction=0.5)
    rows = sft_rows(train, seed=5, early_stop_fraction=0.6)
    assert rows == sft_rows(train, seed=5, early_stop_fraction=0.6)
    texts = [r["messages"][-1]["content"] for r in rows]
    two_step = [i for i, p in enumerate(train) if p.solution.count("=") == 2]
    cut = [i for i in two_step if texts[i] != train[i].solution]
    assert 0.5 < len(cut) / len(two_step) < 0.7
    for i in cut:
        first, value = re.fullmatch(r"(.+ = (\d+))\. \\boxed\{(\d+)\}", texts[i]).group(1, 3)
        assert train[i].solution.startswith(first + ". ") and first.endswith(f"= {value}")
        # the intermediate differs from the answer unless the second step leaves it unchanged
        assert score("math", texts[i], rows[i]["label"]) == float(value == train[i].label)
    assert all(texts[i] == p.solution for i, p in enumerate(train) if i not in cut)
    assert sft_rows(train, seed=5) == sft_rows(train, seed=5, early_stop_fraction=0.0)
