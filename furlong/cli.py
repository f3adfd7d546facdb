"""The `furlong` command: subcommands, with the run flags generated from config.py.

Every error a user can cause (bad flag, bad file, bad row) ends as one line on
stderr and exit code 2; nothing is written before the inputs have been checked.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from furlong.cli_flags import UsageError, _Parser, add_config_flags, config_from_namespace
from furlong.config import Config
from furlong.config_checks import sglang_flags_set, validate
from furlong.config_train_flags import start_notes
from furlong.flag_file import apply_flag_file

EXIT_USAGE = 2
MAX_SYNTHETIC_ROWS = 10_000_000   # `prepare synthetic` builds every row in memory (~1 GB at this size)


def parse_config(argv: Sequence[str], command: str = "train", reward_given: bool = False) -> Config:
    """Flags -> validated Config (raises UsageError / ValueError); `reward_given`: see validate."""
    parser = _Parser(prog=f"furlong {command}", add_help=False)
    add_config_flags(parser, command)
    cfg = config_from_namespace(apply_flag_file(parser.parse_args(list(argv)), command))
    validate(cfg, command, reward_given)
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
                   help="override one setting of the preset (a DemoScale field in furlong/commands/demo_scale.py, "
                        "ToolDemoScale in tool_demo.py for --task calculator); repeatable")
    d.add_argument("--task", default="synthetic", choices=("synthetic", "calculator"),
                   help="synthetic: arithmetic in the head; calculator: GRPO teaches the model to call a "
                        "calculator tool (furlong/commands/tool_demo.py)")
    b = sub.add_parser("bench", help="benchmark one RL step of a workload file")
    b.add_argument("--workload", required=True, metavar="FILE", help="(required) workload file (bench/*_workload.json)")
    b.add_argument("--output", default=None, metavar="FILE.json",
                   help="results as JSON (default: $OUT/bench.json when $OUT is set, else none)")
    b.add_argument("--parts", default="all",
                   help="all, or a comma list of the parts to run (see furlong/bench/workload.py)")
    b.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp8_e4m3"),
                   help="the engine's KV cache in the generating parts (default: auto, the model's dtype)")
    b.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="the trainer's fp32 masters, gradients and AdamW state in CPU memory")
    b.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="AdamW's moments in CPU memory, streamed to the GPU for each update (masters and "
                        "gradients stay on the GPU)")
    b.add_argument("--fsdp-reshard-after-forward", action="store_true",
                   help="free each layer's gathered weights after its forward (saves one compute-dtype copy of "
                        "the model)")
    b.add_argument("--offload-rollout-level", nargs="+", default=["kv_cache", "weight"],
                   choices=("kv_cache", "weight"),
                   help="weight (the default, as furlong train's): the engine's weights are given back while the "
                        "trainer runs (its memory plan reserves none for them); kv_cache alone keeps them")
    b.add_argument("--lora-rank", type=int, default=0, metavar="R", help="train LoRA adapters of rank R on all "
                   "linear layers (default: 0, full-parameter)")
    b.add_argument("--lora-alpha", type=float, default=16.0, metavar="A", help="LoRA alpha (default: 16)")
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
    e.add_argument("--merged", action="store_true",
                   help="LoRA checkpoint: write base + adapters as one HF checkpoint (default: a peft adapter folder)")
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
        from furlong.config_debug_flags import start_up_notes
        notes = start_up_notes(cfg) + (start_notes(cfg) if command == "train" else [])
        for note in notes:
            print(f"furlong: note: {note}", file=sys.stderr)
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
    if args.command == "demo" and args.task == "calculator":
        from furlong.commands.tool_demo import run_tool_demo
        return run_tool_demo(args.output_dir, seed=args.seed, quick=args.quick, device=args.device,
                             settings=args.settings)
    if args.command == "demo":
        from furlong.commands.demo import run_demo
        return run_demo(args.output_dir, seed=args.seed, quick=args.quick, device=args.device,
                        settings=args.settings)
    if args.command == "bench":
        from furlong.bench import run_bench
        if args.fsdp_cpu_offload and args.optimizer_cpu_offload:
            raise ValueError("--optimizer-cpu-offload: cannot be combined with --fsdp-cpu-offload: give one of them")
        return run_bench(args.workload, args.output, args.parts, args.kv_dtype, args.fsdp_cpu_offload,
                         args.lora_rank, args.lora_alpha, optimizer_offload=args.optimizer_cpu_offload,
                         reshard_after_forward=args.fsdp_reshard_after_forward,
                         offload_weights="weight" in args.offload_rollout_level)
    if args.command == "plot":
        from furlong.commands.plot import plot_run
        print(f"plot: wrote {plot_run(args.run_dir, args.output)}")
        return 0
    if args.command == "export":
        from furlong.commands.export import export_hf
        export_hf(args.load, args.output, args.hf_checkpoint, ckpt_step=args.ckpt_step, overwrite=args.overwrite,
                  merged=args.merged)
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
