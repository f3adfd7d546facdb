"""furlong's answer to every miles flag: accepted, accepted-and-ignored, or refused with a reason.

miles' flags (miles_flag_names.py) are its own plus those of the two systems it drives: Megatron-LM
(the trainer) and an SGLang server with its router (the rollout), placed by Ray. furlong replaces all
three (FSDP2 over torch.distributed, a built-in engine in the trainer's process, torchrun), so their
flags are refused with one line saying what furlong does instead, rather than being silently dropped.

A flag's answer: accepted when config.py defines it (a field or one of its `aliases`);
accepted-and-ignored when that field is marked sglang=True or ignored="why" (the CLI notes it once at
start-up);
otherwise refused, in the first category of REFUSALS whose group or prefix matches, else "not
supported yet". Prefixes cover the Megatron and SGLang families miles' list cannot name in full.

`python -m furlong.miles_flags` prints docs/miles_flags.md (a test checks the committed copy is current).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from furlong.config import Config
from furlong.miles_flag_names import MILES_FLAGS


@dataclass(frozen=True)
class Refusal:
    category: str                      # what part of miles the flag configures
    reason: str                        # why furlong has no such flag, and what it does instead
    groups: tuple[str, ...] = ()       # miles groups (miles_flag_names.py) in this category
    prefixes: tuple[str, ...] = ()     # flag-name prefixes in this category, whatever their group


UNSUPPORTED = Refusal("a feature furlong lacks", "not supported yet")
# First match wins: the parallelism prefixes come before the Megatron group they mostly belong to.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("SGLang servers and their router",
            "the built-in engine runs in the trainer's process, so there is no server or router to configure; "
            "its own settings are the --rollout-* flags (furlong train --help)",
            groups=("sglang", "sglang_router", "router", "prefill_decode_disaggregation", "session"),
            prefixes=("--sglang-", "--eval-sglang-", "--no-sglang-", "--miles-router-", "--use-miles-router")),
    Refusal("Ray placement",
            "furlong launches with torchrun or --actor-num-gpus-per-node, not Ray, and the engine always shares "
            "the trainer's GPUs",
            groups=("cluster",), prefixes=("--ray-", "--critic-num-", "--offload-", "--no-offload-")),
    Refusal("Megatron model parallelism",
            "furlong trains with FSDP2 over torch.distributed: every rank holds a shard of every layer, so there "
            "is no tensor/pipeline/context/expert split; scale with torchrun ranks",
            prefixes=("--tensor-model-parallel-", "--pipeline-", "--context-parallel-",
                      "--expert-model-parallel-", "--expert-tensor-parallel-", "--sequence-parallel",
                      "--decoder-first-pipeline-", "--decoder-last-pipeline-", "--virtual-pipeline-",
                      "--num-layers-per-virtual-pipeline-", "--dp-replicate-")),
    Refusal("Megatron-LM",
            "furlong trains HF checkpoints with FSDP2 over torch.distributed and reads the architecture from "
            "config.json; its optimizer, schedule and checkpoint flags are in furlong train --help",
            groups=("megatron", "custom_megatron_plugins", "mtp_training"),
            prefixes=("--moe-", "--no-gradient-", "--use-distributed-optimizer", "--overlap-", "--recompute-",
                      "--fp8-", "--transformer-impl", "--attention-backend")),
)


def furlong_flags() -> dict[str, dataclasses.Field]:
    """Every flag config.py defines (names and aliases) -> its field."""
    out: dict[str, dataclasses.Field] = {}
    for group in dataclasses.fields(Config):
        for f in dataclasses.fields(group.default_factory):  # type: ignore[arg-type]
            for name in ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]:
                out[name] = f
    return out


def miles_group(flag: str) -> str | None:
    return next((g for g, names in MILES_FLAGS.items() if flag in names), None)


def refusal_for(flag: str) -> Refusal:
    """The category a flag furlong does not define falls in (UNSUPPORTED if none matches)."""
    group = miles_group(flag)
    for r in REFUSALS:
        if group in r.groups or flag.startswith(r.prefixes):
            return r
    return UNSUPPORTED


def refusal_line(flag: str) -> str | None:
    """'--X is a miles flag for <category>: <reason>' when `flag` is a miles flag furlong lacks;
    None for a flag that is not miles' (the caller's did-you-mean applies) or that furlong defines."""
    if flag in furlong_flags():
        return None
    r = refusal_for(flag)
    if miles_group(flag) is None and r is UNSUPPORTED:   # matched nothing: not known to be miles'
        return None
    return f"{flag} is a miles flag for {r.category}: {r.reason}"


def answer(flag: str, defined: dict[str, dataclasses.Field]) -> tuple[str, str]:
    """(answer, note) for one miles flag: accepted | accepted, ignored | refused."""
    f = defined.get(flag)
    if f is not None and f.metadata.get("sglang"):
        return "accepted, ignored", "tunes SGLang only; noted once at start-up as not applying to the built-in engine"
    if f is not None and f.metadata.get("ignored"):
        return "accepted, ignored", f"{f.metadata['ignored']}; noted once at start-up"
    if f is not None:   # a field's `miles` note says where furlong's reading departs from miles'
        canonical = "--" + f.name.replace("_", "-")
        notes = ([] if canonical == flag else [f"alias of {canonical}"]) + [f.metadata.get("miles", "")]
        return "accepted", "; ".join(n for n in notes if n)
    r = refusal_for(flag)
    return "refused", r.reason if r is UNSUPPORTED else f"{r.category}: {r.reason}"


def render() -> str:
    defined = furlong_flags()
    rows = sorted((flag, group) for group, names in MILES_FLAGS.items() for flag in names)
    answers = [(flag, group, *answer(flag, defined)) for flag, group in rows]
    counts = {a: sum(1 for row in answers if row[2] == a) for a in ("accepted", "accepted, ignored", "refused")}
    lines = ["# miles flags in furlong", "",
             "Generated by `python -m furlong.miles_flags` from furlong/config.py and furlong/miles_flag_names.py;",
             "do not edit (tests/test_miles_flags.py checks it is current).", "",
             f"{len(answers)} miles flags: {counts['accepted']} accepted, {counts['accepted, ignored']} accepted "
             f"and ignored, {counts['refused']} refused. A refused flag stops `furlong train/sft/eval` with "
             "exit 2 and the one line below. Flags of the Megatron and SGLang families not listed here are "
             "refused by prefix the same way.", "",
             "Refusal reasons:", ""]
    lines += [f"- **{r.category}**: {r.reason}" for r in REFUSALS]
    lines += [f"- **{UNSUPPORTED.category}**: {UNSUPPORTED.reason}", "",
              "| miles flag | miles group | furlong | note |", "|---|---|---|---|"]
    for flag, group, ans, note in answers:
        short = note.split(":")[0] if ans == "refused" and note != UNSUPPORTED.reason else note
        lines.append(f"| `{flag}` | {group} | {ans} | {short} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
