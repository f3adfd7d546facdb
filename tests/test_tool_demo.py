"""`furlong demo --task calculator`: the calculator SFT data match what the multi-turn rollout feeds the
model, the tool-call rate metric, and the quick preset end to end (data, tokenizer, model, SFT, GRPO
with the calculator, evals, evals.json and the plot).

The CPU preset (tool-call rate and accuracy rising) is measured by hand: BENCHMARKS.md.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

from furlong.tasks.calculator_task import TOOL_TAGS, corpus, sft_rows, tool_call_text
from furlong.tasks.synthetic import make_problems
from furlong.tasks.tokenizer import build_tokenizer
from furlong.tools.tool_calls import parse_tool_calls, tool_result_ids


def _problems(n=200):
    train, _ = make_problems(n, 1, seed=3, max_number=999, max_factor=999, two_step_fraction=0.3)
    return train


def test_sft_rows_split_tool_and_head_solutions():
    problems = _problems()
    rows = sft_rows(problems, 0.3, seed=1)
    calls = [r for r in rows if len(r["messages"]) == 2 and r["messages"][1]["content"].startswith(TOOL_TAGS[0])]
    finals = [r for r in rows if len(r["messages"]) == 4]
    heads = [r for r in rows if len(r["messages"]) == 2 and r not in calls]
    assert len(calls) == len(finals) and len(calls) + len(heads) == len(problems)
    assert 0.2 < len(calls) / len(problems) < 0.4
    for r in finals:     # the call, the calculator's true result, and that result boxed
        call = parse_tool_calls(r["messages"][1]["content"])[0]
        assert call.name == "calculator" and r["messages"][2]["content"] == r["label"]
        assert r["messages"][3]["content"] == f"\\boxed{{{r['label']}}}"
    assert all(r["messages"][1]["content"].endswith(f"\\boxed{{{r['label']}}}") for r in heads)
    assert sft_rows(problems, 0.3, seed=1) == rows and sft_rows(problems, 0.3, seed=2) != rows


def test_sft_conversation_is_what_the_rollout_builds(tmp_path):
    """Rendered through the demo tokenizer, a tool-using SFT conversation is token for token the
    rollout's: prompt, the model's call turn and its end token, tool_result_ids, the answer."""
    problems = _problems(50)
    tok_dir = build_tokenizer(corpus(problems), tmp_path / "tok", vocab_size=400, added_tokens=TOOL_TAGS)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == 400 and all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in TOOL_TAGS)
    row = next(r for r in sft_rows(problems, 1.0) if len(r["messages"]) == 4)
    msgs = row["messages"]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = ids(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))
    call = ids(msgs[1]["content"] + tok.eos_token)
    tool, _ = tool_result_ids(tok, parse_tool_calls(msgs[1]["content"]), [msgs[2]["content"]])
    answer = ids(msgs[3]["content"] + tok.eos_token)
    full = ids(tok.apply_chat_template(msgs, tokenize=False).rstrip("\n"))
    assert prompt + call + tool + answer == full
    assert tool_call_text("1 + 2").startswith("<tool_call>\n{") and parse_tool_calls(tool_call_text("1 + 2"))


def test_tool_call_ratio():
    from furlong.rollout.rollout_metrics import tool_call_ratio
    from furlong.types import Sample
    mk = lambda meta: Sample(prompt=None, group_id=0, index=0, response_ids=[1], response_text="",  # noqa: E731
                             rollout_log_probs=[0.0], finish_reason="stop", metadata=meta)
    assert tool_call_ratio([mk({"num_tool_calls": 2}), mk({"num_tool_calls": 0}), mk({}), mk({"num_tool_calls": 1})]) \
        == 0.5
    assert tool_call_ratio([mk({}), mk({})]) is None


def test_quick_tool_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "furlong", "demo", "--task", "calculator", "--quick",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    pct = r"\d+\.\d% -> \d+\.\d%"
    assert re.fullmatch(rf"tool demo: held-out accuracy {pct} greedy \(tool calls {pct}\), {pct} sampled "
                        rf"\(T=1, 2 per prompt; tool calls {pct}\) \(\d+s\)", last), last
    evals = json.loads((out / "evals.json").read_text())
    assert set(evals) == {"calc", "calc_sampled", "sampled_samples_per_prompt"}
    for name in ("calc", "calc_sampled"):
        assert set(evals[name]) == {"accuracy", "tool_call_rate"}
        for series in evals[name].values():
            assert [x for x, _ in series] == [0, 2] and all(0.0 <= v <= 1.0 for _, v in series)
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "rollout"]
    assert len(steps) == 2 and all(0.0 <= r["rollout/tool_call_ratio"] <= 1.0 for r in steps)
    assert all(r["rollout/turns/mean"] >= 1.0 for r in steps)
    # the greedy eval really is greedy and the sampled one samples: n samples per prompt in its file
    sampled = (out / "grpo" / "samples" / "eval_calc_sampled_0.jsonl").read_text().splitlines()
    greedy = (out / "grpo" / "samples" / "eval_calc_0.jsonl").read_text().splitlines()
    assert len(sampled) == 2 * len(greedy) == 32
    png = out / "grpo" / "metrics.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
