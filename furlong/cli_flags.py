"""The argparse layer of `furlong`: one-line errors, and the train/sft/eval flags generated from config.py.

Errors are one line (no usage dump); prefix abbreviations are off, and an unknown flag gets the
nearest known one ("did you mean"), or, when it belongs to another of train/sft/eval, which one, or,
when it is a miles flag furlong lacks, why and what furlong does instead (miles_flags.py).
Each of train/sft/eval gets only the flags it reads (COMMAND_FLAGS), so no flag is silently ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import Any, Callable

from furlong.config import Config


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (no usage dump) and exits 2. Prefix
    abbreviations are off (`--rollout-batch 4` must not mean --rollout-batch-size); an unknown flag
    gets the nearest known one as a suggestion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.foreign: dict[str, str] = {}   # flag -> a command that has it (set by add_config_flags)
        self.argv: list[str] = []           # what this parser was last given (for a "required" error)

    def _all_flags(self) -> list[str]:
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._all_flags() if isinstance(sub, _Parser) else list(sub._option_string_actions)
        return flags

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self.argv = list(args) if args is not None else sys.argv[1:]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        prefix = "unrecognized arguments: "
        unknown = None
        if message.startswith(prefix):
            unknown = next((a for a in message[len(prefix):].split() if a.startswith("-")), None)
        elif "are required" in message:   # a misspelt required flag: say which flag was not understood
            known = set(self._all_flags())
            unknown = next((a for a in self.argv if a.startswith("--") and a.split("=")[0] not in known), None)
            if unknown is not None:
                message += f"; {unknown} is not a flag"
        if unknown is not None:
            if unknown.split("=")[0] in self.foreign:
                raise UsageError(f"{self.prog}: {unknown.split('=')[0]} is a flag of furlong "
                                 f"{self.foreign[unknown.split('=')[0]]}, not of {self.prog} (see {self.prog} --help)")
            from furlong.miles_flags import refusal_line   # Megatron/SGLang/Ray flags: why not, and instead
            miles = refusal_line(unknown.split("=")[0])
            if miles is not None:
                raise UsageError(f"{self.prog}: {miles}")
            near = difflib.get_close_matches(unknown.split("=")[0], sorted(set(self._all_flags())), n=1, cutoff=0.6)
            if near:
                message += f" (did you mean {near[0]}?)"
        raise UsageError(f"{self.prog}: {message}")


class UsageError(Exception):
    pass


_PATH_WORDS = ("checkpoint", "path", "data", "dir", "save", "load")
GROUP_TITLES = {"data": "data and model", "sft": "furlong sft only", "log": "outputs and logging",
                "ckpt": "checkpoints", "algo": "algorithm", "optim": "optimizer", "batch": "batching and memory",
                "parallel": "processes and devices", "lora": "LoRA (adapters on a frozen base)",
                "eval_set": "eval sets", "reward_mode": "reward calls", "metrics": "extra metrics",
                "tracking": "wandb and TensorBoard", "debug": "debugging",
                "ref": "reference model and optimizer state", "length": "run length", "custom": "user loss and reward functions"}


def _metavar(f: dataclasses.Field, base: str) -> str:
    if base == "str" and any(w in f.name for w in _PATH_WORDS):
        return "PATH"
    return {"int": "N", "float": "X", "str": "STR"}[base]


def _help(f: dataclasses.Field) -> str:
    help_ = f.metadata.get("help", "")
    default = (f.default if f.default is not dataclasses.MISSING
               else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    if isinstance(default, (dict, list)) and not default:
        default = None
    elif isinstance(default, list):   # as typed on the command line (nargs="+")
        default = " ".join(map(str, default))
    if default not in (None, False, ""):
        help_ += f" (default: {default})"
    return help_


def _flag_kwargs(f: dataclasses.Field) -> dict[str, Any]:
    t = str(f.type).replace(" ", "")
    if t.startswith("bool"):
        return {"action": "store_true", "help": _help(f)}
    if t.startswith("list[int]"):
        return {"nargs": f.metadata.get("nargs", "+"), "type": int, "metavar": "N", "help": _help(f)}
    if t.startswith("list["):
        return {"nargs": f.metadata.get("nargs", "+"), "type": str, "metavar": "STR", "help": _help(f)}
    base = t.split("|")[0]
    conv: Callable[[str], Any] = {"int": int, "float": float, "str": str}[base]
    optional = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}   # bare flag: const
    return {"type": conv, "metavar": _metavar(f, base), "help": _help(f), **optional}


def _config_groups() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(Config)]  # type: ignore[misc]


# The flags each command reads: config groups, less the fields of them it never reads. A flag outside
# its command's set is refused ("a flag of furlong train"), so `eval --lr` cannot be silently ignored.
_EVAL_ROLLOUT = {"num_rollout", "rollout_batch_size", "n_samples_per_prompt", "over_sampling_batch_size",
                 "dynamic_sampling_filter_path", "rollout_num_gpus", "rollout_function_path", "partial_rollout",
                 "mask_offpolicy_in_partial_rollout"}
COMMAND_FLAGS: dict[str, dict[str, set[str]]] = {
    "train": {g: set() for g in ("data", "reward", "rollout", "eval", "algo", "optim", "batch", "parallel", "ckpt",
                                 "log", "lora", "eval_set", "reward_mode", "metrics", "tracking", "debug", "ref", "length", "custom")},
    "sft": {"data": {"label_key", "apply_chat_template", "rollout_shuffle", "rollout_seed", "rollout_max_prompt_len",
                     "apply_chat_template_kwargs", "tool_key", "metadata_key"},
            "optim": set(), "batch": {"num_steps_per_rollout", "update_weight_buffer_size"}, "parallel": set(),
            "ckpt": {"save_interval", "load", "ckpt_step"}, "sft": set(), "length": {"start_rollout_id"},
            "log": {"use_tensorboard", "use_wandb", "wandb_project", "wandb_group", "wandb_key",
                    "disable_wandb_random_suffix", "save_debug_rollout_data", "ci_test", "ci_disable_kl_checker",
                    "ci_metric_checker_key", "ci_metric_checker_threshold"}, "tracking": set()},
    "eval": {"data": {"prompt_data", "rollout_shuffle"}, "reward": set(), "rollout": _EVAL_ROLLOUT,
             "eval": {"eval_interval", "skip_eval_before_train"}, "parallel": set(), "ckpt": {"save", "save_interval"},
             "log": {"save_debug_rollout_data", "ci_test", "ci_disable_kl_checker", "ci_metric_checker_key",
                     "ci_metric_checker_threshold"},
             "eval_set": set(), "reward_mode": set(), "metrics": {"get_mismatch_metrics"}, "tracking": set()},
}
# flags each command requires, marked in --help (config_checks.validate enforces them)
REQUIRED = {"train": {"hf_checkpoint", "prompt_data"}, "sft": {"hf_checkpoint", "prompt_data"},
            "eval": {"eval_prompt_data"}}


def _command_fields(command: str) -> list[tuple[str, dataclasses.Field]]:
    skip = COMMAND_FLAGS[command]
    return [(attr, f) for attr, cls in _config_groups() if attr in skip
            for f in dataclasses.fields(cls) if f.name not in skip[attr]]


def _flag_names(f: dataclasses.Field) -> list[str]:
    return ["--" + f.name.replace("_", "-")] + list(f.metadata.get("aliases", []))


def add_config_flags(parser: argparse.ArgumentParser, command: str = "train") -> None:
    groups: dict[str, Any] = {}
    for attr, f in _command_fields(command):
        if attr not in groups:
            groups[attr] = parser.add_argument_group(GROUP_TITLES.get(attr, attr))
        kwargs = _flag_kwargs(f)
        if f.name in REQUIRED.get(command, ()):
            kwargs["help"] = "(required) " + kwargs["help"]
        groups[attr].add_argument(*_flag_names(f), dest=f"{attr}.{f.name}", default=argparse.SUPPRESS, **kwargs)
    if isinstance(parser, _Parser):   # for "--lr: a flag of furlong train, not of furlong eval"
        parser.foreign = {}
        for other in COMMAND_FLAGS:   # train first: the command most flags belong to
            for _, f in _command_fields(other) if other != command else []:
                for n in _flag_names(f):
                    parser.foreign.setdefault(n, other)


def config_from_namespace(ns: argparse.Namespace) -> Config:
    cfg = Config()
    for key, value in vars(ns).items():
        if "." in key:
            attr, name = key.split(".", 1)
            setattr(getattr(cfg, attr), name, value)
    return cfg
