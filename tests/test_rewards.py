"""Tests for furlong.rewards: extraction, normalization, symbolic checks, registry, offline scoring."""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from furlong.rewards import compute_rewards, extract_answer, get_reward_fn, score
from furlong.rewards.math_reward import answers_match, normalize, to_number
from furlong.rewards.offline import ScoreReport, run_score
from furlong.rewards.registry import RewardError
from furlong.types import Prompt, Sample

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"   # a sample shipped with the tests


def math(response: str, label: str) -> float:
    return score("math", response, label)


# ------------------------------------------------------------------ extraction

@pytest.mark.parametrize("response, expected", [
    (r"so \boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),     # nested braces
    (r"first \boxed{3}, then \boxed{5}.", "5"),                          # several -> last
    (r"\boxed{3} and a truncated \boxed{5", "3"),                        # unclosed ignored
    (r"\fbox{42}", "42"),
    (r"$\boxed 7$", "7"),
    (r"\boxed {12}", "12"),
    ("She makes 9 * 2 = $18.\n#### 18", "18"),
    ("#### 3\nmore text\n#### 4 eggs", "4 eggs"),                        # last ####
    ("#### **18**", "18"),
    ("So the answer is 18.", "18"),
    ("THE ANSWER IS: 3.5. Done.", "3.5"),
    ("the answer is 2, then the final answer is $1,000, ok", "$1,000"),  # last phrase, cut at ', '
    ("The final answer is **7**\nbye", "7"),
    (r"The answer is 4 but \boxed{5}", "5"),                             # boxed wins
    ("#### 6\nso the answer is 5", "6"),                                # #### before 'answer is'
    (r"\boxed{18}<|im_end|>", "18"),
    ("#### 18<|endoftext|>", "18"),
    ("The answer is 18<|im_end|>", "18"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response", ["", "I think it is 18", r"\boxed{18", "answer: 18", "####"])
def test_extract_answer_absent_or_empty(response):
    assert not extract_answer(response)
    assert math(response, "18") == 0.0


# --------------------------------------------------------------- normalization

@pytest.mark.parametrize("answer, label", [
    ("1,080", "1080"), ("$1,080", "1,080"), (r"\$18.00", "18"), ("18.0", "18"), ("18.", "18"),
    ("18 dollars", "18"), ("18 dollars per day", "18"), ("5 cm", "5"), ("5cm", "5"),
    (r"18\text{ dollars}", "18"), (r"\text{18}", "18"), (r"5 \mbox{cm}^2", "5"),
    ("50%", "50"), (r"50\%", "50"), ("+7", "7"), ("-7", "-7"), ("\u22127", "-7"),
    ("3/4", "0.75"), (r"\frac{3}{4}", "0.75"), (r"\dfrac{3}{4}", "3/4"), (r"\tfrac34", "0.75"),
    (r"-\frac{1}{2}", "-0.5"), (r"1\frac{1}{2}", "1.5"), (r"90^\circ", "90"), (r"90^{\circ}", "90"),
    (r"1\,000", "1000"), (r"1{,}000", "1000"), ("1,000,000", "1000000"), (r"1\!000", "1000"),
    (r"\$18/\text{hour}", "18"), ("x = 5", "5"), ("0.333333", r"\frac{1}{3}"), ("1e3", "1000"), (".5", "1/2"),
])
def test_equivalent_numbers(answer, label):
    assert math(rf"\boxed{{{answer}}}", label) == 1.0
    assert math(f"#### {answer}", label) == 1.0
    assert math(f"So the answer is {answer}", label) == 1.0


@pytest.mark.parametrize("answer, label", [
    ("7", "-7"), ("17", "18"), ("1000001", "1000000"), ("0.33", r"\frac{1}{3}"), ("2x", "2"),
    ("3/4", "4/3"), ("3/x", "3"), ("1,23", "123"), ("18 + 1", "18"), (r"\frac{1}{0}", "1"), ("50", "0.5"),
    ("x+2", "x+1"), (r"\sqrt{2}", "1.41"), ("A", "B"),
])
def test_wrong_answers_score_zero(answer, label):
    assert math(rf"\boxed{{{answer}}}", label) == 0.0


def test_to_number_and_normalize():
    assert to_number(normalize(r"\$1{,}234.50")) == pytest.approx(1234.5)
    assert to_number("12 apples") == 12
    assert to_number("x") is None and to_number("2x") is None and to_number("3/0") is None
    assert normalize(r"\left( 1, 2 \right)") == "( 1, 2 )"


# -------------------------------------------------------------------- symbolic

@pytest.mark.parametrize("answer, label", [
    (r"\frac{1}{2}", "0.5"), (r"2\sqrt{2}", r"\sqrt{8}"), ("x+1", "1+x"),
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"), ("(x+1)^2", "x^2+2x+1"), ("2(x+1)", "2x+2"),
    (r"\sqrt[3]{8}", "2"), (r"\frac{\pi}{2}", r"\pi/2"), (r"2 \cdot 3", "6"), (r"2 \times 3", "6"),
    ("3xy", "3yx"), (r"(x+1)^{200}(x-1)^{200}", r"(x^2-1)^{200}"),
    ("(x+1)^{9999}", "(1+x)^{9999}"), ("1.4142136", r"\sqrt{2}"), ("(1,2)", "(1, 2)"), (r"\left(1,2\right)", "(1,2)"),
])
def test_symbolic_equivalence(answer, label):
    assert math(rf"The result is \boxed{{{answer}}}.", label) == 1.0


@pytest.mark.parametrize("answer", [
    r"10^{10^{10}}", "2^{99999999}", "9**9**9", "x" * 500, r"\frac{" * 50, "__import__('os')",
    "exec(1)", "lambda: 1", "1" * 5000, "((((((((((", r"\sqrt[", "2^(3^(4^5))",
    r"(x+1)^{9999} - (x+2)^{9998}", r"(x+y+z)^{99}(x-y)^{99}(z+1)^{99}",  # simplify would take minutes
])
def test_pathological_inputs_are_refused_fast(answer):
    start = time.perf_counter()
    assert math(rf"\boxed{{{answer}}}", "1") == 0.0
    assert math(f"The answer is {answer}", "x") == 0.0
    assert time.perf_counter() - start < 2.0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(r"\{}^_$%0123456789x+-*/=().,  abc#") +
                                [r"\boxed{", r"\frac", r"\sqrt", "####", "the answer is "]),
               max_size=40).map("".join),
       st.text(max_size=12))
def test_garbage_never_raises(response, label):
    # The unguarded internals, so a crash is seen here rather than hidden by math_score's catch-all.
    answer = extract_answer(response)
    if answer is not None:
        answers_match(answer, label)
        answers_match(label, answer)
    assert math(response, label) in (0.0, 1.0)


def test_label_in_boxed_form_and_non_string_like_labels():
    assert math(r"\boxed{12}", r"\boxed{12}") == 1.0
    assert math(r"\boxed{12}", "") == 0.0


# ------------------------------------------------------------------- real data

def _gsm8k_rows(name: str):
    path = GSM8K / f"{name}.jsonl"
    assert path.exists(), f"{path}: the shipped GSM8K sample is missing"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["answer"] for line in f if line.strip()]


@pytest.mark.parametrize("split", ["test", "train"])
def test_gsm8k_reference_solutions(split):
    """Every reference solution of the shipped sample earns 1 against its own label and 0 against label + 1."""
    answers = _gsm8k_rows(split)
    assert len(answers) >= 150
    failures = []
    for n, answer in enumerate(answers, start=1):
        label = answer.rsplit("####", 1)[1].strip()
        wrong = str(int(label.replace(",", "")) + 1)
        if math(answer, label) != 1.0 or math(answer, wrong) != 0.0:
            failures.append((n, label))
    assert not failures, failures[:10]


def test_gsm8k_reformatted_as_boxed_model_output():
    """The same labels, answered in the \\boxed{} style the prepared prompts ask for."""
    answers = _gsm8k_rows("test")
    rng = random.Random(0)
    for answer in rng.sample(answers, min(300, len(answers))):
        label = answer.rsplit("####", 1)[1].strip()
        body = answer.rsplit("####", 1)[0]
        styled = rng.choice([r"\boxed{%s}", r"\boxed{\$%s}", r"\boxed{%s \text{ dollars}}", "The answer is %s."])
        assert math(body + styled % label, label.replace(",", "")) == 1.0
        assert math(body + styled % label, str(int(label.replace(",", "")) - 1)) == 0.0


# -------------------------------------------------------------------- registry

def _sample(response: str, label: str, index: int = 0) -> Sample:
    prompt = Prompt(row=0, raw="q", text="q", token_ids=[1, 2], label=label)
    return Sample(prompt=prompt, group_id=0, index=index, response_ids=[3], response_text=response,
                  rollout_log_probs=[-0.1], finish_reason="stop")


def test_builtin_math_reward_fn():
    fn = get_reward_fn("math", None)
    samples = [_sample(r"\boxed{4}", "4"), _sample(r"\boxed{5}", "4"), _sample("#### 1,000", "1000")]
    assert compute_rewards(fn, samples) == [1.0, 0.0, 1.0]


def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--rm-type: unknown reward 'x' \(dapo, deepscaler, f1, math, boxed_<one of them>, random, "
                                         r"deterministic_random\)"):
        get_reward_fn("x", None)
    with pytest.raises(ValueError, match="--rm-type: unknown reward 'gemma_math'"):
        score("gemma_math", "a", "b")
    with pytest.raises(ValueError, match="--rm-type"):
        get_reward_fn(None, None)
    with pytest.raises(ValueError, match="--custom-rm-path: cannot import module 'no_such_mod_zz'"):
        get_reward_fn("math", "no_such_mod_zz.fn")
    with pytest.raises(ValueError, match="--custom-rm-path: expected 'module.function'"):
        get_reward_fn(None, "justaname")
    (tmp_path / "rw_errs_mod.py").write_text("def two(args, sample):\n    return 1.0\nvalue = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="--custom-rm-path: module 'rw_errs_mod' has no function 'missing'"):
        get_reward_fn(None, "rw_errs_mod.missing")
    with pytest.raises(ValueError, match="has no function 'value'"):
        get_reward_fn(None, "rw_errs_mod.value")
    with pytest.raises(ValueError, match="one positional argument"):
        get_reward_fn(None, "rw_errs_mod.two")


def test_custom_reward_sync_and_async(tmp_path, monkeypatch):
    (tmp_path / "rw_custom_mod.py").write_text(
        "import asyncio\n"
        "def length(sample):\n    return len(sample.response_text)\n"
        "async def label_match(sample):\n"
        "    await asyncio.sleep(0.01)\n"
        "    return float(sample.response_text == sample.prompt.label)\n"
        "def bad(sample):\n    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [_sample("abc", "abc"), _sample("de", "x", index=1)]
    sync_fn = get_reward_fn("math", "rw_custom_mod.length")   # custom wins over --rm-type
    assert compute_rewards(sync_fn, samples) == [3.0, 2.0]
    async_fn = get_reward_fn(None, "rw_custom_mod.label_match")
    many = samples * 20
    start = time.perf_counter()
    assert compute_rewards(async_fn, many) == [1.0, 0.0] * 20
    assert time.perf_counter() - start < 0.3  # awaited together, not one by one (40 x 10 ms)

    async def inside_a_running_loop():
        return compute_rewards(async_fn, samples)
    assert asyncio.run(inside_a_running_loop()) == [1.0, 0.0]
    with pytest.raises(RewardError, match="reward function bad returned str .* for sample .*, not a number"):
        compute_rewards(get_reward_fn(None, "rw_custom_mod.bad"), samples)


# --------------------------------------------------------------------- offline

def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_run_score_writes_scores(tmp_path):
    src = _write_jsonl(tmp_path / "preds.jsonl", [
        json.dumps({"response": r"\boxed{18}", "label": "18"}),
        json.dumps({"response": "#### 7", "label": 8}),            # non-string label
        "",                                                         # blank lines are skipped
        json.dumps({"response": "The answer is 1,000.", "label": "1000"}),
    ])
    report = run_score(src, "math")
    assert isinstance(report, ScoreReport)
    assert (report.num_rows, report.num_correct) == (3, 2)
    assert report.accuracy == pytest.approx(2 / 3)
    out = tmp_path / "preds.scores.jsonl"
    assert report.output_path == str(out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["score"]) for r in rows] == [(1, 1.0), (2, 0.0), (4, 1.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl", "preds.scores.jsonl"]

    custom = _write_jsonl(tmp_path / "c.jsonl", [json.dumps({"out": r"\boxed{2}", "gold": "2"})])
    report = run_score(custom, "math", response_key="out", label_key="gold", output_path=tmp_path / "o.jsonl")
    assert (report.num_rows, report.accuracy) == (1, 1.0)
    assert json.loads((tmp_path / "o.jsonl").read_text())["score"] == 1.0


@pytest.mark.parametrize("lines, message", [
    ([json.dumps({"response": "a", "label": "1"}), json.dumps({"label": "1"})], r"row 2: missing key 'response'"),
    ([json.dumps({"response": "a"})], r"row 1: missing key 'label'"),
    ([json.dumps({"response": "a", "label": "1"}), "", "{not json"], r"row 3: malformed JSON"),
    (["[1, 2]"], r"row 1: expected a JSON object"),
    ([""], "no rows to score"),
])
def test_run_score_errors(tmp_path, lines, message):
    src = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message) as info:
        run_score(src, "math")
    assert "bad.jsonl" in str(info.value)
    assert not (tmp_path / "bad.scores.jsonl").exists()


def test_run_score_bad_arguments(tmp_path):
    src = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"response": "a", "label": "1"})])
    with pytest.raises(ValueError, match="--rm-type: unknown reward"):
        run_score(src, "nope")
    with pytest.raises(ValueError, match="--output: .* is the --input"):
        run_score(src, "math", output_path=src)
    with pytest.raises(ValueError, match="missing.jsonl: cannot read"):
        run_score(tmp_path / "missing.jsonl", "math")
