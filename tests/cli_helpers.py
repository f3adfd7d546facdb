"""Helpers shared by the CLI-level test files: tiny run assets, in-process `furlong` calls, one-line errors."""
from __future__ import annotations

from pathlib import Path

from tiny_checkpoints import write_tiny_checkpoint

from furlong.cli import main


def tiny_assets(d: Path) -> Path:
    """A tiny random checkpoint (d/ckpt) and the synthetic task (d/data), for CPU runs of `furlong`."""
    from furlong.tasks.synthetic import prepare_synthetic
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(d / "data", 8, 2, 0)
    return d


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`furlong ARGV` in-process: (exit code, stdout, stderr), set-up output dropped first."""
    capsys.readouterr()
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def one_line(err: str, *needles: str) -> str:
    """stderr (start-up notes aside) is one line holding every needle, and no traceback; that line."""
    lines = [x for x in err.strip().splitlines() if not x.startswith("furlong: note:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]
