"""Tests for the `deepscaler` and `dapo` reward types and the two fixed `math` grading cases."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from furlong.rewards import compute_rewards, get_reward_fn, score
from furlong.rewards.dapo import dapo_verdict, normalize_final_answer
from furlong.rewards.deepscaler import graded_part, strict_last_boxed
from furlong.rewards.math_normalize import expand_frac_shorthand
from furlong.rewards.offline import run_score
from furlong.types import Prompt, Sample


def deepscaler(response: str, label: str) -> float:
    return score("deepscaler", response, label)


def dapo(response: str, label: str) -> float:
    return score("dapo", response, label)


# ------------------------------------------------------------ math: fixed cases

@pytest.mark.parametrize("response, label", [
    (r"\boxed{No solution}", "no solution"),
    (r"\boxed{\text{No Solution}}", "no solution"),
    ("The answer is NO SOLUTION.", "No solution"),
    (r"\boxed{Infinitely many}", r"\text{infinitely many}"),
    (r"\boxed{\frac{3}{4} \text{ cup}}", r"\frac34"),
    (r"\boxed{\dfrac{3}{4}\text{ cups}}", r"\tfrac34"),
    (r"\boxed{0.75 \text{ cup}}", r"\frac 3 4"),
    (r"\boxed{1\frac{1}{2} \text{ cups}}", r"1\frac12"),
    (r"\boxed{\frac{3}{4}}", r"\frac3{4}"),
    (r"\boxed{\frac{\pi}{2}}", r"\frac\pi2"),
])
def test_math_fixed_cases_match(response, label):
    assert score("math", response, label) == 1.0


@pytest.mark.parametrize("response, label", [
    (r"\boxed{Yes}", "no solution"),
    (r"\boxed{no solutions}", "no solution"),
    (r"\boxed{X}", "x"),                            # case still matters for variables
    (r"\boxed{2X + 1}", "2x+1"),
    (r"\boxed{\frac{4}{3} \text{ cup}}", r"\frac34"),
    (r"\boxed{\frac{3}{5} \text{ cup}}", r"\frac34"),
    (r"\boxed{34 \text{ cups}}", r"\frac34"),
])
def test_math_fixed_cases_still_reject(response, label):
    assert score("math", response, label) == 0.0


@pytest.mark.parametrize("text, expected", [
    (r"\frac34", r"\frac{3}{4}"), (r"\frac3{4}", r"\frac{3}{4}"), (r"\frac{3}4", r"\frac{3}{4}"),
    (r"\frac 3 4", r"\frac{3}{4}"), (r"\frac{\frac12}{3}", r"\frac{\frac{1}{2}}{3}"),
    (r"\frac\pi2", r"\frac{\pi}{2}"), (r"\frac{a+b}{c}", r"\frac{a+b}{c}"),
    (r"x\frac12y", r"x\frac{1}{2}y"), (r"\frac34 + \frac{1", r"\frac{3}{4} + \frac{1"), (r"\frac", r"\frac"),
])
def test_expand_frac_shorthand(text, expected):
    assert expand_frac_shorthand(text) == expected


# -------------------------------------------------------------------- deepscaler

@pytest.mark.parametrize("response, label, expected", [
    (r"Let me think.</think>The answer is \boxed{42}.", "42", 1.0),
    (r"Let me think.</think>The answer is \boxed{41}.", "42", 0.0),
    (r"The answer is \boxed{42}.", "42", 0.0),                        # no </think>: no answer
    (r"So \boxed{42}.</think>The answer is 42.", "42", 0.0),          # box only inside thinking
    (r"</think>The answer is 42.", "42", 0.0),                        # no box after </think>
    (r"a</think>b \boxed{1}</think>\boxed{7}", "7", 1.0),             # after the LAST </think>
    (r"a</think>\boxed{7}</think>no box here", "7", 0.0),
    (r"</think>\boxed{3}, no wait: \boxed{5}", "5", 1.0),             # several boxes: the last
    (r"</think>\boxed{3}, no wait: \boxed{5}", "3", 0.0),
    (r"</think>\boxed{4}, then \boxed{5", "4", 0.0),                  # last box truncated: 0
    (r"</think>\boxed 5", "5", 0.0),                                   # no braces
    (r"</think>\fbox{5}", "5", 0.0),
    ("</think>#### 5", "5", 0.0),
    (r"</think>\boxed{18}<|im_end|>", "18", 1.0),
    (r"</think>\boxed{12}", r"\boxed{12}", 1.0),                      # boxed label
    (r"</think>\boxed{12}", r"\boxed{12", 0.0),                       # unreadable label
    (r"</think>\boxed{12}", "", 0.0),
    (r"</think>\boxed{}", "", 0.0),
    (r"</think>\boxed{\frac{1}{2}}", "0.5", 1.0),                     # math equivalence
    (r"</think>\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"</think>\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"</think>\boxed{\$1,000}", "1000", 1.0),
    (r"</think>\boxed{\frac{3}{4} \text{ cup}}", r"\frac34", 1.0),
    (r"</think>\boxed{\text{No solution}}", "no solution", 1.0),
    (r"</think>\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"###Response Sure. \boxed{9}", "9", 1.0),                       # the other marker
    (r"###Response \boxed{9} ###Response \boxed{8}", "9", 1.0),      # up to a second marker
    (r"###Response \boxed{9} ###Response \boxed{8}", "8", 0.0),
    (r"###Response \boxed{9}</think>\boxed{8}", "8", 1.0),           # </think> wins
])
def test_deepscaler(response, label, expected):
    assert deepscaler(response, label) == expected


def test_deepscaler_parts():
    assert graded_part("x</think>y</think>z") == "z"
    assert graded_part("a###Responseb###Responsec") == "b"
    assert graded_part(r"\boxed{1}") is None
    assert strict_last_boxed(r"\boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert strict_last_boxed(r"\boxed{1} \boxedx{2}") is None
    assert strict_last_boxed("no box") is None


# -------------------------------------------------------------------------- dapo

@pytest.mark.parametrize("response, label, expected", [
    ("Let me think.\nAnswer: 42", "42", 1.0),
    ("Let me think.\nAnswer: 41", "42", -1.0),
    ("answer: 42", "42", 1.0),                                        # any case
    ("ANSWER :  42  ", "42", 1.0),
    ("Final Answer: 7", "7", 1.0),                                    # anywhere in a line
    ("Answer:\n42", "42", 1.0),                                       # value on the next line
    ("Answer: 3\nHmm, no.\nAnswer: 5", "5", 1.0),                     # the last one
    ("Answer: 3\nHmm, no.\nAnswer: 5", "3", -1.0),
    (r"The answer is \boxed{42}.", "42", -1.0),                       # no Answer: line
    ("", "42", -1.0),
    ("Answer: $42$", "42", 1.0),
    (r"Answer: \boxed{42}", "42", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: 1000", "1,000", 1.0),
    ("Answer: x = 42", "42", 1.0),
    ("Answer: 42 dollars", "42", 1.0),
    (r"Answer: 90^\circ", "90", 1.0),
    ("Answer: 42<|im_end|>", "42", 1.0),
    ("Answer: 42.", "42", -1.0),                                      # no numeric equivalence
    ("Answer: 42.0", "42", -1.0),
    ("Answer: +42", "42", -1.0),
    ("Answer: 042", "42", -1.0),
    ("Answer: 42 apples", "42", -1.0),                                # not a listed unit
    ("Answer: 12", "12.0", 1.0),                                      # the label is an integer
    ("Answer: 1000", "1e3", 1.0),
    ("Answer: -7", "-7", 1.0),
    ("Answer: 42\n" + "x" * 400, "42", -1.0),                         # only the last 300 chars
    ("x" * 400 + "\nAnswer: 42", "42", 1.0),
    ("Answer: 2", "2.5", -1.0),                                       # deviation: miles truncates
    ("Answer: 2.5", "2.5", 1.0),
    ("Answer: no solution", "no solution", 1.0),                     # deviation: miles raises
    ("Answer: No solution", "no solution", -1.0),                    # exact, case included
    ("Answer: 12345678901234567891", "12345678901234567891", 1.0),   # deviation: exact big ints
    ("Answer: anything", "", -1.0),
])
def test_dapo(response, label, expected):
    assert dapo(response, label) == expected


def test_dapo_verdict_and_normalization():
    assert dapo_verdict("Answer: $1,000$", "1000") == (True, "1000")
    assert dapo_verdict("Answer: 7", "8") == (False, "7")
    assert dapo_verdict(r"\boxed{8}", "8") == (False, None)
    assert normalize_final_answer(r"\frac12") == r"\frac{1}{2}"
    assert normalize_final_answer(r"\sqrt3") == r"\sqrt{3}"
    assert normalize_final_answer(r"\text{Monday}") == "Monday"
    assert normalize_final_answer("$5$ square units") == "5"
    assert normalize_final_answer(r"1 \text{ and } x") == "1,x"
    assert normalize_final_answer("3 and 4") == "3and4"  # only `\text{and}` becomes a comma


# ---------------------------------------------------------- registry and offline

def _sample(response: str, label: str) -> Sample:
    prompt = Prompt(row=0, raw="q", text="q", token_ids=[1], label=label)
    return Sample(prompt=prompt, group_id=0, index=0, response_ids=[2], response_text=response,
                  rollout_log_probs=[-0.1], finish_reason="stop")


def test_reward_fns_by_name():
    samples = [_sample(r"</think>\boxed{4}" + "\nAnswer: 4", "4"), _sample(r"\boxed{4}", "4")]
    assert compute_rewards(get_reward_fn("deepscaler", None), samples) == [1.0, 0.0]
    assert compute_rewards(get_reward_fn("dapo", None), samples) == [1.0, -1.0]
    assert compute_rewards(get_reward_fn("math", None), samples) == [1.0, 1.0]


def test_offline_accuracy_counts_correct_rows_for_dapo(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps({"response": r, "label": "5"})
                             for r in ["Answer: 5", "Answer: 6", "Answer: 5", "nothing"]) + "\n")
    report = run_score(src, "dapo")
    assert (report.num_rows, report.num_correct) == (4, 2)
    assert report.accuracy == 0.5 and report.mean_score == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(r"\{}^$0123456789x+-/=:., abcA") +
                                [r"\boxed{", r"\frac", "</think>", "###Response", "Answer:", "\n"]),
               max_size=40).map("".join),
       st.text(max_size=12))
def test_new_types_never_raise(response, label):
    assert deepscaler(response, label) in (0.0, 1.0)
    assert dapo(response, label) in (1.0, -1.0)
