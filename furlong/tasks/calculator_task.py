"""The synthetic task with a calculator: the word problems of synthetic.py with numbers too large to
work out in the head (operands up to `digits` digits: 5 by default, so products of 9-10 digits), and
the calculator tool's spec on every row, for the multi-turn tool recipe
(tools/calculator_generate.py).

Files written: train.parquet, test.parquet with columns messages (the user turn), label, answer and
tools (a JSON string of [calculator.SPEC]: pass `--tool-key tools` (the default) and
`--apply-chat-template`, and the chat template renders the tool for the model).

With `sft_tool_fraction` set, also sft.parquet: worked solutions for `furlong sft`, where that
fraction of the problems (a seeded choice) is solved with the tool, in Qwen3's format (the assistant
turn is a `<tool_call>` block, a "tool" turn holds the calculator's result, and a second assistant turn
boxes it), and the rest in the head ("123 * 456 = 56088. \\boxed{56088}", as synthetic.py). `furlong
sft` trains the last assistant turn of a row, so a tool-using solution gives two rows: the call
(user, assistant) and the answer (user, assistant, tool, assistant). A model fine-tuned on it calls
the tool on about that fraction of its samples; what it computes in the head is mostly wrong.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from furlong.tasks import user_turn, write_parquet_atomic
from furlong.tasks.synthetic import Problem, make_problems, prompt_row
from furlong.tools.calculator import SPEC, calculator

TOOL_TAGS = ("<tool_call>", "</tool_call>")   # single tokens in Qwen3's vocabulary (tasks/tokenizer.py added_tokens)


def tool_call_text(expression: str) -> str:
    """An assistant turn calling the calculator, as Qwen3 writes one (tools/tool_calls.py reads it)."""
    call = json.dumps({"name": SPEC["function"]["name"], "arguments": {"expression": expression}})
    return f"{TOOL_TAGS[0]}\n{call}\n{TOOL_TAGS[1]}"


def tool_conversation(p: Problem) -> list[dict]:
    """user, the call, the tool's result, the boxed answer: the problem solved with the calculator."""
    return user_turn(p.question) + [
        {"role": "assistant", "content": tool_call_text(p.expression)},
        {"role": "tool", "name": SPEC["function"]["name"], "content": calculator(p.expression)},
        {"role": "assistant", "content": f"\\boxed{{{p.label}}}"}]


def sft_rows(problems: list[Problem], tool_fraction: float, seed: int = 0) -> list[dict]:
    """SFT rows (module docstring): `tool_fraction` of the problems with the tool (two rows each), the
    rest worked in the head (one row)."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"sft_tool_fraction: must be in [0, 1], got {tool_fraction}")
    rng = random.Random(seed)
    rows = []
    for p in problems:
        meta = {"label": p.label, "answer": p.answer}
        if rng.random() < tool_fraction:
            chat = tool_conversation(p)
            rows += [{"messages": chat[:2], **meta}, {"messages": chat, **meta}]
        else:
            rows.append({"messages": user_turn(p.question) + [{"role": "assistant", "content": p.solution}], **meta})
    return rows


def corpus(problems: list[Problem]) -> list[str]:
    """Texts to train the demo tokenizer on: every user turn, both kinds of solution and the tool result."""
    return [m["content"] for p in problems for m in tool_conversation(p)] + [p.solution for p in problems]


def prepare_calculator_task(output_dir: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                            digits: int = 5, two_step_fraction: float = 0.25,
                            sft_tool_fraction: float | None = None) -> dict[str, int]:
    """Write train/test (and with `sft_tool_fraction`, sft) parquet files to `output_dir`; return rows per file."""
    if not 2 <= digits <= 12:
        raise ValueError(f"digits: must be in [2, 12], got {digits}")
    train, test = calculator_problems(num_train, num_test, seed, digits, two_step_fraction)
    if not train or not test:
        raise ValueError(f"num_train/num_test: both must be >= 1, got {num_train}/{num_test}")
    tools = json.dumps([SPEC])
    out = Path(output_dir)
    write_parquet_atomic([{**prompt_row(p), "tools": tools} for p in train], out / "train.parquet")
    write_parquet_atomic([{**prompt_row(p), "tools": tools} for p in test], out / "test.parquet")
    counts = {"train": len(train), "test": len(test)}
    if sft_tool_fraction is not None:
        rows = sft_rows(train, sft_tool_fraction, seed)
        write_parquet_atomic(rows, out / "sft.parquet")
        counts["sft"] = len(rows)
    return counts


def calculator_problems(num_train: int, num_test: int, seed: int, digits: int,
                        two_step_fraction: float) -> tuple[list[Problem], list[Problem]]:
    """synthetic.make_problems with every operand (factors too) up to `digits` digits."""
    largest = 10 ** digits - 1
    return make_problems(num_train, num_test, seed, max_number=largest, max_factor=largest,
                         two_step_fraction=two_step_fraction)
