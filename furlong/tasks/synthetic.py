"""Synthetic arithmetic word problems in GSM8K format (`furlong prepare synthetic`).

Problems like "Tom has 3 apples and buys 5 more. How many apples does Tom
have?" built from templates, names and objects, with +, - (never below zero)
and small *; a fraction of them take two steps. Solutions are deliberately
short ("3 + 5 = 8. \\boxed{8}") so a ~1M-parameter model can learn the format
and much of the arithmetic in a few CPU minutes of SFT, leaving headroom for GRPO.

Files written (same columns as GSM8K prepare, plus `answer`):
  train.parquet, test.parquet  messages (user turn), label, answer
  sft.parquet                  messages (user turn + assistant solution), label, answer — the train problems
`answer` is the solution followed by "#### N" (GSM8K style). Test questions
never occur in train (distinct question text). Everything is a pure function
of the seed and the difficulty settings.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from furlong.tasks import user_turn, write_parquet_atomic

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Eva", "Jack", "Nora"]
OBJECTS = ["apples", "pencils", "marbles", "cookies", "books", "stickers", "coins", "shells",
           "cards", "oranges", "balloons", "stamps"]

# One-step templates: (question format, operator). {a} {b} are the operands in
# the order they appear in the expression.
ONE_STEP = [
    ("{n} has {a} {o} and buys {b} more. How many {o} does {n} have?", "+"),
    ("{n} picks {a} {o} in the morning and {b} in the afternoon. How many {o} did {n} pick in total?", "+"),
    ("There are {a} {o} in a box. {n} puts in {b} more. How many {o} are in the box now?", "+"),
    ("{n} has {a} {o} and gives {b} to {m}. How many {o} does {n} have left?", "-"),
    ("There are {a} {o} on the table. {n} takes {b} of them. How many {o} are left?", "-"),
    ("{n} had {a} {o} and lost {b}. How many {o} does {n} have now?", "-"),
    ("{n} has {a} bags with {b} {o} in each bag. How many {o} does {n} have?", "*"),
    ("{n} buys {a} packs of {o}. Each pack has {b} {o}. How many {o} does {n} buy?", "*"),
]
# Two-step templates: a op1 b op2 c, evaluated left to right.
TWO_STEP = [
    ("{n} has {a} {o}, buys {b} more and then gives {c} to {m}. How many {o} does {n} have now?", "+", "-"),
    ("{n} had {a} {o}, lost {b} and then found {c}. How many {o} does {n} have now?", "-", "+"),
    ("{n} has {a} {o}. {m} gives {n} {b} more and then {c} more. How many {o} does {n} have?", "+", "+"),
    ("{n} has {a} boxes with {b} {o} in each box and gives away {c}. How many {o} are left?", "*", "-"),
]

_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


@dataclass(frozen=True)
class Problem:
    question: str        # the word problem
    expression: str      # e.g. "3 + 5" or "7 + 4 - 3" (left to right)
    solution: str        # e.g. "3 + 5 = 8. \boxed{8}"
    label: str           # the final number, e.g. "8"

    @property
    def answer(self) -> str:
        """GSM8K-style answer text: the solution, then '#### N'."""
        return f"{self.solution}\n#### {self.label}"


def _operand(rng: random.Random, op: str, left: int, max_number: int, max_factor: int) -> int:
    """A right operand for `left op ?` keeping results non-negative and products small."""
    if op == "-":
        return rng.randint(1, left)  # every template's left operand is >= 1
    if op == "*":
        return rng.randint(2, max_factor)
    return rng.randint(1, max_number)


def _make_problem(rng: random.Random, max_number: int, max_factor: int, two_step: bool) -> Problem:
    name, other = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    if two_step:
        fmt, *ops = rng.choice(TWO_STEP)
    else:
        fmt, op = rng.choice(ONE_STEP)
        ops = [op]
    first = rng.randint(2, max_factor) if ops[0] == "*" else rng.randint(1, max_number)
    values, steps, acc = [first], [], first
    for op in ops:
        b = _operand(rng, op, acc, max_number, max_factor)
        new = _APPLY[op](acc, b)
        steps.append(f"{acc} {op} {b} = {new}.")
        values.append(b)
        acc = new
    question = fmt.format(n=name, m=other, o=obj, **dict(zip("abc", values)))
    expression = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
    solution = " ".join(steps) + f" \\boxed{{{acc}}}"
    return Problem(question=question, expression=expression, solution=solution, label=str(acc))


def make_problems(num_train: int, num_test: int, seed: int = 0, max_number: int = 20,
                  max_factor: int = 5, two_step_fraction: float = 0.25) -> tuple[list[Problem], list[Problem]]:
    """Generate train and test problems with pairwise-distinct question texts (so the splits are disjoint)."""
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train/num_test: must be >= 0, got {num_train}/{num_test}")
    if max_number < 1 or max_factor < 2:
        raise ValueError(f"max_number/max_factor: need >= 1 / >= 2, got {max_number}/{max_factor}")
    if not 0.0 <= two_step_fraction <= 1.0:
        raise ValueError(f"two_step_fraction: must be in [0, 1], got {two_step_fraction}")
    rng = random.Random(seed)
    total = num_train + num_test
    seen: set[str] = set()
    problems: list[Problem] = []
    # Give up after this many duplicates in a row: the settings then allow (about)
    # fewer distinct questions than asked for; a merely crowded space still
    # yields a new question far more often than once in this many draws.
    max_misses, misses = 2000, 0
    while len(problems) < total and misses < max_misses:
        p = _make_problem(rng, max_number, max_factor, rng.random() < two_step_fraction)
        if p.question in seen:
            misses += 1
            continue
        seen.add(p.question)
        problems.append(p)
        misses = 0
    if len(problems) < total:
        raise ValueError(f"num_train+num_test: only {len(problems)} distinct problems found for {total} "
                         f"with max_number={max_number}, max_factor={max_factor}")
    return problems[:num_train], problems[num_train:]


def prompt_row(p: Problem) -> dict:
    """RL/eval row: the user turn only."""
    return {"messages": user_turn(p.question), "label": p.label, "answer": p.answer}


def plain_solution(p: Problem) -> str:
    """The solution ending in prose ("So the result is 8.") instead of \\boxed{8}: a style
    the math reward does not read (it wants \\boxed, '####' or 'the answer is')."""
    return p.solution.rsplit(" \\boxed", 1)[0] + f" So the result is {p.label}."


def direct_solution(p: Problem) -> str:
    """The answer alone, no worked steps ("\\boxed{8}"): the reward reads it, but a small model
    that answers a two-step problem without writing the steps is right far less often."""
    return f"\\boxed{{{p.label}}}"


def early_stop_solution(p: Problem) -> str | None:
    """A multi-step solution cut after its first step, boxing that step's result ("7 + 4 = 11.
    \\boxed{11}" for 7 + 4 - 3): the answer of a solver that stops before the work is done.
    None for one-step problems (nothing to cut)."""
    steps = p.solution.rsplit(" \\boxed", 1)[0].split(". ")
    if len(steps) < 2:
        return None
    first = steps[0].rstrip(".")
    return f"{first}. \\boxed{{{first.rsplit('= ', 1)[1]}}}"


def sft_rows(problems: list[Problem], unboxed_fraction: float = 0.0, seed: int = 0,
             direct_fraction: float = 0.0, early_stop_fraction: float = 0.0) -> list[dict]:
    """SFT rows: the user turn followed by the assistant's short solution.

    `unboxed_fraction` of the rows (a seeded choice) end in the plain style instead,
    so the fine-tuned model answers in both styles, as a base model's habits differ
    from what a reward reads; the demo's GRPO then has a format to learn.
    `direct_fraction` of the other rows give the boxed answer without the steps: the fine-tuned
    model then sometimes skips the working, and GRPO has a way of solving to prefer.
    `early_stop_fraction` of the multi-step problems' remaining rows stop after the first step
    (early_stop_solution): a teacher that often quits before the work is done. Above one half, the
    fine-tuned model's most likely continuation after the first step is to stop, so its greedy
    answers to multi-step problems are wrong while its samples still finish the work at times: the
    reward alone has to teach it to finish.
    """
    for name, value in (("unboxed_fraction", unboxed_fraction), ("direct_fraction", direct_fraction),
                        ("early_stop_fraction", early_stop_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: must be in [0, 1], got {value}")
    rng = random.Random(seed)
    rows = []
    for p in problems:
        text = plain_solution(p) if rng.random() < unboxed_fraction else p.solution
        if direct_fraction > 0 and text == p.solution and rng.random() < direct_fraction:
            text = direct_solution(p)
        short = early_stop_solution(p) if early_stop_fraction > 0 and text == p.solution else None
        if short is not None and rng.random() < early_stop_fraction:
            text = short
        rows.append({"messages": user_turn(p.question) + [{"role": "assistant", "content": text}],
                     "label": p.label, "answer": p.answer})
    return rows


def corpus(problems: list[Problem]) -> list[str]:
    """Texts to train the demo tokenizer on: every user turn and solution."""
    return [text for p in problems for text in (user_turn(p.question)[0]["content"], p.solution)]


def prepare_synthetic(output_dir: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                      max_number: int = 20, max_factor: int = 5,
                      two_step_fraction: float = 0.25, sft_unboxed_fraction: float = 0.0,
                      sft_direct_fraction: float = 0.0, sft_early_stop_fraction: float = 0.0) -> dict[str, int]:
    """Write train/test/sft parquet files to `output_dir`; return rows per file."""
    train, test = make_problems(num_train, num_test, seed, max_number, max_factor, two_step_fraction)
    if not train or not test:
        raise ValueError(f"num_train/num_test: both must be >= 1, got {num_train}/{num_test}")
    out = Path(output_dir)
    write_parquet_atomic([prompt_row(p) for p in train], out / "train.parquet")
    write_parquet_atomic([prompt_row(p) for p in test], out / "test.parquet")
    write_parquet_atomic(sft_rows(train, sft_unboxed_fraction, seed, sft_direct_fraction, sft_early_stop_fraction),
                         out / "sft.parquet")
    return {"train": len(train), "test": len(test), "sft": len(train)}
