"""Output targets that never destroy data: checked before any work, replaced only in what the command writes.

Rules for every command that writes a named target (`export --output`, `sft --save`, `score --output`):
- a target that is, contains or lies inside one of the command's sources (`--load`, `--hf-checkpoint`,
  `--input`) is refused, with or without --overwrite: reading and replacing the same files is never meant;
- a non-empty target directory, or an existing target file, is refused unless --overwrite is given;
- a symlink is followed: the directory or file it points to receives the output, the link stays;
- with --overwrite an HF checkpoint directory gets its own files replaced (weights: every *.safetensors
  and the shard index, so no stale shard outlives the new weights; config.json; tokenizer files), and
  every other file in it stays;
- a save's temporary directory carries the writing process' id, so a later save removes the ones a
  killed process left (`.NAME.tmp-PID-*`) and never one a live process is still writing.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Mapping



def _overlap(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def _check_sources(target: Path, flag: str, sources: Mapping[str, str | os.PathLike | None]) -> None:
    for src_flag, src in sources.items():
        if src is None or src == "":
            continue
        how = _overlap(target, Path(src).resolve())
        if how is not None:
            raise ValueError(f"{flag}: {target} {how} the {src_flag} {src}; write the output elsewhere")


def check_dir_target(target: str | os.PathLike, flag: str, sources: Mapping[str, str | os.PathLike | None],
                     overwrite: bool) -> Path:
    """The directory `target` resolves to, after the module's rules; ValueError naming `flag` otherwise."""
    t = Path(target).resolve()
    _check_sources(t, flag, sources)
    if t.exists() and not t.is_dir():
        raise ValueError(f"{flag}: {target} exists and is not a directory")
    if t.is_dir() and any(t.iterdir()) and not overwrite:
        raise ValueError(f"{flag}: {target} is not empty; choose an empty or new directory, or pass --overwrite "
                         "to replace the checkpoint's files in it (other files are kept)")
    from furlong.run.preflight import check_writable
    check_writable(t, flag)
    return t


def check_file_target(target: str | os.PathLike, flag: str, sources: Mapping[str, str | os.PathLike | None],
                      overwrite: bool) -> Path:
    """The file `target` resolves to, after the module's rules; ValueError naming `flag` otherwise."""
    t = Path(target).resolve()
    _check_sources(t, flag, sources)
    if t.is_dir():
        raise ValueError(f"{flag}: {target} is a directory; give a file name")
    if t.exists() and not overwrite:
        raise ValueError(f"{flag}: {target} exists; pass --overwrite to replace it")
    from furlong.run.preflight import check_writable
    check_writable(t.parent, flag)
    return t


def temp_prefix(out_dir: Path) -> str:
    """Name prefix of `out_dir`'s temporary save directory (beside it): holds this process' id."""
    return f".{out_dir.name}.tmp-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by another user
        return True
    return True


def remove_stale_temps(out_dir: Path) -> list[Path]:
    """Remove the temporary directories of saves to `out_dir` whose process is gone; returns them."""
    pattern = re.compile(re.escape(f".{out_dir.name}.tmp-") + r"(\d+)-.*")
    removed = []
    if not out_dir.parent.is_dir():
        return removed
    for p in out_dir.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _owned(name: str) -> bool:
    """A file an HF checkpoint directory owns (what hf_io.save_hf writes, plus a shard index)."""
    from furlong.models.hf_io import TOKENIZER_FILES
    return name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json",
                                                     *TOKENIZER_FILES)


def install_checkpoint(tmp: Path, out_dir: Path) -> None:
    """Move the finished checkpoint in `tmp` to `out_dir`: one rename when `out_dir` is new or empty,
    else (--overwrite, checked earlier) the checkpoint's own files are replaced and the rest kept."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
        return
    new: Iterable[Path] = sorted(tmp.iterdir())
    for old in out_dir.iterdir():
        if old.is_file() and _owned(old.name) and not (tmp / old.name).exists():
            old.unlink()     # a stale shard or index of the replaced weights
    for f in new:
        os.replace(f, out_dir / f.name)
    tmp.rmdir()
