"""The calculator tool (safe, bounded), Qwen3-style tool-call parsing, tool tokens through the chat
template, the calculator generate function on a scripted conversation, and a `furlong train` run
with the calculator on the CPU."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_checkpoints import build_tokenizer, write_tiny_checkpoint  # noqa: E402

from furlong.engine.async_front import Turn  # noqa: E402
from furlong.engine.sampling import SamplingParams  # noqa: E402
from furlong.rollout.async_rollout import new_sample  # noqa: E402
from furlong.rollout.custom_generate import GenerateArgs  # noqa: E402
from furlong.tools import calculator_generate  # noqa: E402
from furlong.tools.calculator import CalculatorError, calculator, evaluate  # noqa: E402
from furlong.tools.tool_calls import ToolCall, parse_tool_calls, tool_result_ids  # noqa: E402
from furlong.types import Prompt  # noqa: E402


def test_calculator_values():
    assert evaluate("12345 * 67890") == 838102050
    assert evaluate("(2 + 3) * -4 ** 2") == -80 and evaluate("7 // 2") == 3 and evaluate("2^10") == 1024
    assert calculator("1 / 4") == "0.25" and calculator("10 / 2") == "5"
    assert calculator("99999 * 99999") == "9999800001"
    assert calculator("2 ** 200") == str(2 ** 200)                  # big ints stay exact


@pytest.mark.parametrize("expr,why", [("__import__('os').system('true')", "unsupported"), ("x + 1", "unsupported"),
                                      ("(1).real", "unsupported"), ("'a' * 3", "unsupported"),
                                      ("True + 1", "unsupported"), ("1 < 2", "unsupported"),
                                      ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
                                      ("9 ** 999", "exponent"), ("99 ** 200", "power longer"),
                                      ("9" * 101, "longer than 100 digits"),
                                      ("10 ** 60 * 10 ** 60", "product longer"), ("1 +" * 200 + "1", "longer than"),
                                      ("(1 + " * 40 + "1" + ")" * 40, "nested deeper"), ("-" * 60 + "1", "nested deeper"),
                                      ("2 +", "not an arithmetic")])
def test_calculator_refuses(expr, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expr)
    assert calculator(expr).startswith("error: ")


def test_parse_tool_calls():
    text = ('I will compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
            '<tool_call>{"name": 5}</tool_call><tool_call>not json</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "3*4"})
    assert calls[1].error and calls[2].error == "tool call is not valid JSON"
    assert parse_tool_calls("no calls here") == []


def test_tool_tokens_are_what_a_full_render_gives():
    """The assistant turn (as the model writes it, ending in its EOS) + the tool tokens == the template's
    render of the whole conversation up to the next assistant turn."""
    tok = build_tokenizer()
    calls = [ToolCall("calculator", {"expression": "3*4"})]
    ids, text = tool_result_ids(tok, calls, ["12"])
    assert text == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"},
            {"role": "tool", "content": "12"}]
    full = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) + "call<|im_end|>"
    assert head + text == full


class ScriptedConversation:
    def __init__(self, tok, replies):
        self.tok, self.replies, self.prompts = tok, list(replies), []

    async def generate(self, token_ids, sampling):
        self.prompts.append(list(token_ids))
        text = self.replies.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return Turn(ids, [-0.5] * len(ids), text, "stop" if text.endswith("<|im_end|>") else "length")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None


class ScriptedFront:
    def __init__(self, conv):
        self.conv = conv

    def conversation(self, seed):
        return self.conv


def test_calculator_generate_runs_the_tool_between_turns():
    tok = build_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call><|im_end|>'
    conv = ScriptedConversation(tok, [call, "\\boxed{56088}<|im_end|>"])
    args = GenerateArgs(engine=ScriptedFront(conv), tokenizer=tok, max_context_len=512)
    prompt = Prompt(row=0, raw="q", text="q", token_ids=tok("q")["input_ids"], label="56088")
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
    sample = asyncio.run(calculator_generate.generate(args, new_sample(prompt, 0, 0), params))
    assert sample.status == sample.Status.COMPLETED and sample.num_turns == 2
    assert sample.metadata["num_tool_calls"] == 1 and "56088" in sample.response_text
    tool = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m == 0]
    assert tok.decode(tool) == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    assert conv.prompts[1] == sample.tokens[:len(conv.prompts[1])]      # turn 2 saw turn 1 and the result
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m == 0)


def test_calculator_run_through_furlong_train(tmp_path):
    """The recipe end to end on the CPU: big-number task with the tool spec in the prompts (--tool-key),
    the calculator generate function, GRPO; a tiny random model (it rarely calls the tool)."""
    from furlong.cli import main
    from furlong.tasks.calculator_task import prepare_calculator_task
    write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_calculator_task(tmp_path / "data", 8, 2, seed=0, digits=5)
    out = tmp_path / "run"
    code = main(["train", "--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data",
                 str(tmp_path / "data" / "train.parquet"), "--input-key", "messages", "--label-key", "label",
                 "--apply-chat-template", "--tool-key", "tools", "--apply-chat-template-kwargs",
                 '{"enable_thinking": false}', "--custom-generate-function-path",
                 "furlong.tools.calculator_generate.generate", "--rm-type", "math", "--num-rollout", "1",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
                 "--rollout-max-context-len", "400", "--eval-prompt-data", "calc",
                 str(tmp_path / "data" / "test.parquet"), "--device", "cpu", "--output-dir", str(out)])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "eval" and "eval/calc" in rows[0]
    step = rows[-1]
    assert step["rollout/turns/mean"] >= 1.0 and "train/loss" in step
