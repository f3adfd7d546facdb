"""The `furlong` command: subcommands, with the run flags generated from config.py.

Every error a user can cause (bad flag, bad file, bad row) ends as one line on
stderr and exit code 2; nothing is written before the inputs have been checked.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from furlong.config import Config
from furlong.config_checks import sglang_flags_set, validate

EXIT_USAGE = 2
MAX_SYNTHETIC_ROWS = 10_000_000   # `prepare synthetic` builds every row in memory (~1 GB at this size)


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (no usage dump) and exits 2. Prefix
    abbreviations are off (`--rollout-batch 4` must not mean --rollout-batch-size); an unknown flag
    gets the nearest known one as a suggestion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _all_flags(self) -> list[str]:
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._all_flags() if isinstance(sub, _Parser) else list(sub._option_string_actions)
        return flags

    foreign: dict[str, str] = {}   # flag -> a command that has it (set by add_config_flags)

    def error(self, message: str) -> None:  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            unknown = next((a for a in message[len(prefix):].split() if a.startswith("-")), None)
            if unknown is not None and unknown.split("=")[0] in self.foreign:
                raise UsageError(f"{self.prog}: {unknown.split('=')[0]} is a flag of furlong "
                                 f"{self.foreign[unknown.split('=')[0]]}, not of {self.prog} (see {self.prog} --help)")
            if unknown is not None:
                near = difflib.get_close_matches(unknown.split("=")[0], sorted(set(self._all_flags())), n=1, cutoff=0.6)
                if near:
                    message += f" (did you mean {near[0]}?)"
        raise UsageError(f"{self.prog}: {message}")


class UsageError(Exception):
    pass


_PATH_WORDS = ("checkpoint", "path", "data", "dir", "save", "load")
GROUP_TITLES = {"data": "data and model", "sft": "furlong sft only", "log": "outputs and logging",
                "ckpt": "checkpoints", "algo": "algorithm", "optim": "optimizer", "batch": "batching and memory",
                "parallel": "processes and devices"}


def _metavar(f: dataclasses.Field, base: str) -> str:
    if base == "str" and any(w in f.name for w in _PATH_WORDS):
        return "PATH"
    return {"int": "N", "float": "X", "str": "STR"}[base]


def _help(f: dataclasses.Field) -> str:
    help_ = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else None
    if default not in (None, False, "", []):
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
    return {"type": conv, "metavar": _metavar(f, base), "help": _help(f)}


def _config_groups() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(Config)]  # type: ignore[misc]


# The flags each command reads: config groups, less the fields of them it never reads. A flag outside
# its command's set is refused ("a flag of furlong train"), so `eval --lr` cannot be silently ignored.
_EVAL_ROLLOUT = {"num_rollout", "rollout_batch_size", "n_samples_per_prompt", "over_sampling_batch_size",
                 "dynamic_sampling_filter_path", "rollout_num_gpus"}
COMMAND_FLAGS: dict[str, dict[str, set[str]]] = {
    "train": {g: set() for g in ("data", "reward", "rollout", "eval", "algo", "optim", "batch", "parallel", "ckpt",
                                 "log")},
    "sft": {"data": {"label_key", "apply_chat_template", "rollout_shuffle", "rollout_seed", "rollout_max_prompt_len"},
            "optim": set(), "batch": {"num_steps_per_rollout", "update_weight_buffer_size"}, "parallel": set(),
            "ckpt": {"save_interval", "load", "ckpt_step"}, "sft": set(),
            "log": {"use_tensorboard", "use_wandb", "wandb_project", "wandb_group", "wandb_key",
                    "disable_wandb_random_suffix", "save_debug_rollout_data", "ci_test", "ci_disable_kl_checker",
                    "ci_metric_checker_key", "ci_metric_checker_threshold"}},
    "eval": {"data": {"prompt_data", "rollout_shuffle"}, "reward": set(), "rollout": _EVAL_ROLLOUT,
             "eval": {"eval_interval", "skip_eval_before_train"}, "parallel": set(), "ckpt": {"save", "save_interval"},
             "log": {"save_debug_rollout_data", "ci_test", "ci_disable_kl_checker", "ci_metric_checker_key",
                     "ci_metric_checker_threshold"}},
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


def parse_config(argv: Sequence[str], command: str = "train") -> Config:
    """Flags -> validated Config (raises UsageError / ValueError)."""
    parser = _Parser(prog=f"furlong {command}", add_help=False)
    add_config_flags(parser, command)
    cfg = config_from_namespace(parser.parse_args(list(argv)))
    validate(cfg, command)
    return cfg


def _build_parser() -> _Parser:
    from furlong import __version__
    p = _Parser(prog="furlong", description="RL post-training for HF causal LMs")
    p.add_argument("--version", action="store_true", help=f"print the version (furlong {__version__}) and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, about in (("train", "GRPO training (miles flags)"), ("sft", "supervised fine-tuning"),
                        ("eval", "evaluate a checkpoint on --eval-prompt-data")):
        sp = sub.add_parser(name, help=about, add_help=True)
        add_config_flags(sp, name)
    prep = sub.add_parser("prepare", help="write prompt data sets")
    psub = prep.add_subparsers(dest="task", required=True, parser_class=_Parser)
    g = psub.add_parser("gsm8k", help="GSM8K jsonl -> parquet (messages + label)")
    g.add_argument("--input", default=None, metavar="DIR",
                   help="DIR with train.jsonl/test.jsonl (default: download with the datasets library)")
    g.add_argument("--output", required=True, metavar="DIR", help="(required) directory for train.parquet and "
                   "test.parquet")
    s = psub.add_parser("synthetic", help="synthetic arithmetic word problems (GSM8K format)")
    s.add_argument("--output", required=True, metavar="DIR",
                   help="(required) directory for train.parquet, test.parquet and sft.parquet")
    s.add_argument("--num-train", type=int, default=2000, metavar="N", help="training problems (default: 2000)")
    s.add_argument("--num-test", type=int, default=200, metavar="N", help="test problems (default: 200)")
    s.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the problem generator (default: 0)")
    sc = sub.add_parser("score", help="score responses offline")
    sc.add_argument("--rm-type", default="math", help="built-in reward: math | deepscaler | dapo (default: math)")
    sc.add_argument("--input", required=True, metavar="FILE.jsonl",
                    help="(required) one JSON object per line with a response and a label")
    sc.add_argument("--response-key", default="response", help="key of the response (default: response)")
    sc.add_argument("--label-key", default="label", help="key of the label (default: label)")
    sc.add_argument("--output", default=None, metavar="FILE",
                    help="per-row scores (default: INPUT.scores.jsonl); an existing file needs --overwrite")
    sc.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    d = sub.add_parser("demo", help="tiny end-to-end demo: SFT then GRPO on synthetic arithmetic")
    d.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where the demo writes data, checkpoints and runs (default: runs/demo-<date-time>)")
    d.add_argument("--seed", type=int, default=0, metavar="N", help="seed of data, model and runs (default: 0)")
    d.add_argument("--quick", action="store_true", help="smaller, faster settings (tests)")
    d.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: the laptop preset; cuda: the GPU preset (a larger model and task, ~10 min on one H200)")
    d.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                   help="override one setting of the preset (a DemoScale field in furlong/commands/demo.py); repeatable")
    b = sub.add_parser("bench", help="benchmark one RL step of a workload file")
    b.add_argument("--workload", required=True, metavar="FILE", help="(required) workload file (bench/workloads/*)")
    b.add_argument("--output", default=None, metavar="FILE.json",
                   help="results as JSON (default: $OUT/bench.json when $OUT is set, else none)")
    b.add_argument("--parts", default="all",
                   help="all, or a comma list of the parts to run (see furlong/bench/workload.py)")
    pl = sub.add_parser("plot", help="one PNG of a run's metrics (reward, eval, length, KL, entropy, time)")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a run's --output-dir (holds metrics.jsonl)")
    pl.add_argument("--output", default=None, metavar="FILE.png", help="default: RUN_DIR/metrics.png")
    e = sub.add_parser("export", help="checkpoint -> HF checkpoint")
    e.add_argument("--load", required=True, metavar="DIR", help="(required) a training run's --save directory")
    e.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="export iteration N (iter_N) instead of the latest")
    e.add_argument("--output", required=True, metavar="DIR",
                   help="(required) new or empty directory for the HF checkpoint (never a source)")
    e.add_argument("--hf-checkpoint", default=None,
                   help="the original checkpoint (config and tokenizer); default: the one the checkpoint records")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --output, replacing its checkpoint files (other files are kept)")
    return p


def _run(argv: list[str]) -> int:
    if argv == ["--version"]:
        from furlong import __version__
        print(f"furlong {__version__}")
        return 0
    if argv and argv[0] in ("train", "sft", "eval"):
        command, rest = argv[0], argv[1:]
        if "-h" in rest or "--help" in rest:
            _build_parser().parse_args([command, "--help"])
        cfg = parse_config(rest, command)
        if command == "eval" and cfg.data.hf_checkpoint is None:   # export's rule: the one --load records
            from furlong.checkpoint.verify import choose_checkpoint
            from furlong.commands.export import source_checkpoint
            choice = choose_checkpoint(cfg.ckpt.load, cfg.ckpt.ckpt_step, None)
            cfg.data.hf_checkpoint = source_checkpoint(cfg.ckpt.load, choice.trainer_state, None)
        notes = sglang_flags_set(cfg)
        if notes:
            print(f"furlong: note: {' '.join(notes)} only tune SGLang and do not apply to the built-in engine",
                  file=sys.stderr)
        if cfg.rollout.rollout_num_gpus_per_engine > 1:
            print(f"furlong: note: --rollout-num-gpus-per-engine {cfg.rollout.rollout_num_gpus_per_engine}: the "
                  "built-in engine runs one data-parallel copy per rank (no tensor parallelism)", file=sys.stderr)
        from furlong.launch.entry import COMMANDS
        return COMMANDS[command](cfg)
    args = _build_parser().parse_args(argv)
    _check_output(args)
    if args.command == "prepare":
        if args.task == "gsm8k":
            from furlong.tasks.gsm8k import prepare_gsm8k
            counts = prepare_gsm8k(args.input, args.output)
        else:
            from furlong.tasks.synthetic import prepare_synthetic
            for flag_name, n in (("--num-train", args.num_train), ("--num-test", args.num_test)):
                if not 1 <= n <= MAX_SYNTHETIC_ROWS:   # all rows are built in memory, silently: bound them
                    raise ValueError(f"{flag_name}: must be in [1, {MAX_SYNTHETIC_ROWS}], got {n}")
            counts = prepare_synthetic(args.output, args.num_train, args.num_test, args.seed)
        print(f"prepare {args.task}: wrote " + ", ".join(f"{k} {v} rows" for k, v in counts.items())
              + f" to {args.output}")
        return 0
    if args.command == "score":
        from furlong.rewards.offline import run_score
        rep = run_score(args.input, args.rm_type, args.response_key, args.label_key, args.output,
                        overwrite=args.overwrite)
        print(f"score: {rep.num_correct}/{rep.num_rows} correct, accuracy {100 * rep.accuracy:.1f}%")
        return 0
    if args.command == "demo":
        from furlong.commands.demo import run_demo
        return run_demo(args.output_dir, seed=args.seed, quick=args.quick, device=args.device,
                        settings=args.settings)
    if args.command == "bench":
        from furlong.bench import run_bench
        return run_bench(args.workload, args.output, args.parts)
    if args.command == "plot":
        from furlong.commands.plot import plot_run
        print(f"plot: wrote {plot_run(args.run_dir, args.output)}")
        return 0
    if args.command == "export":
        from furlong.commands.export import export_hf
        export_hf(args.load, args.output, args.hf_checkpoint, ckpt_step=args.ckpt_step, overwrite=args.overwrite)
        print(f"export: wrote {args.output}")
        return 0
    raise UsageError(f"furlong: unknown command {args.command!r}")


def _check_output(args: argparse.Namespace) -> None:
    """--output of prepare/export (a directory) and score (a file) must be writable before any work
    starts, and the error names the flag."""
    from furlong.run.preflight import check_writable
    target = getattr(args, "output", None)
    if target is None or args.command not in ("prepare", "export", "score"):
        return
    check_writable(Path(target).parent if args.command == "score" else target, "--output")


def main(argv: Sequence[str] | None = None) -> int:
    from furlong.termination import Terminated, sigterm_raises, terminated_line
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with sigterm_raises():
            return _run(argv)
    except Terminated as e:
        print(terminated_line(e), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("furlong: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"{e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        # User errors (bad input, a run that cannot succeed): one line, no traceback.
        # Anything else is a bug and keeps its traceback.
        from furlong.launch.entry import error_line, exit_code_for
        code = exit_code_for(e)
        if code is None:
            raise
        print(error_line(e), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
