"""--custom-config-path: flag values from a YAML file, as miles reads it (keys are dest names: `use_tis: true`,
`lr: 1.0e-6`), or from an inline `base64:<payload>` of one, miles' second form.

Deviations from miles, both deliberate: a flag given on the command line wins over the file (miles lets
the file win, with a logged warning); and every key must be a flag of the command (a miles flag furlong
refuses gets its refusal line), where miles sets any key on its namespace for user functions to read
(furlong's user functions read flags only: user_code.miles_args). Values are checked against the flag's
type: one line naming the file and the key, exit 2.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
from pathlib import Path
from typing import Any

FLAG = "--custom-config-path"
INLINE = "base64:"


def _read(value: str) -> tuple[str, str]:
    """(text, how errors name it)."""
    if value.startswith(INLINE):
        try:
            return base64.b64decode(value[len(INLINE):], validate=True).decode(), "its base64 payload"
        except (binascii.Error, UnicodeDecodeError) as e:
            raise ValueError(f"{FLAG}: the base64: payload does not decode ({e})") from None
    try:
        return Path(value).read_text(encoding="utf-8"), value
    except OSError as e:
        raise ValueError(f"{FLAG}: cannot read {value} ({e.strerror or type(e).__name__})") from None


def _convert(value: Any, f: dataclasses.Field, where: str, key: str) -> Any:
    t = str(f.type).replace(" ", "")
    bad = ValueError(f"{FLAG}: {where}: {key}: expected {t.replace('|None', ' or null')}, got {value!r}")
    if value is None:
        if "None" not in t:
            raise bad
        return None
    if t.startswith("bool"):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(value, bool) and "const" in f.metadata:   # a flag that may be given bare: true is bare
        return f.metadata["const"] if value else None
    if isinstance(value, bool):
        raise bad
    if t.startswith("list["):
        items = value if isinstance(value, list) else [value]
        elem = int if t.startswith("list[int]") else str
        if any(isinstance(v, (bool, list, dict)) or (elem is int and not isinstance(v, int)) for v in items):
            raise bad
        return [elem(v) for v in items]
    base = t.split("|")[0]
    if base == "int" and isinstance(value, int):
        return value
    if base == "float" and isinstance(value, (int, float, str)):
        try:
            return float(value)   # YAML 1.1 reads 1e-6 (no dot) as a string; float() takes it
        except ValueError:
            raise bad from None
    if base == "str" and isinstance(value, (str, int, float)):
        return str(value)
    raise bad


def apply_flag_file(ns: argparse.Namespace, command: str) -> argparse.Namespace:
    """ns (only the flags given, by `group.name` dest) with the file's values for the flags not given."""
    path = getattr(ns, "custom.custom_config_path", None)
    if path is None:
        return ns
    import yaml
    text, where = _read(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{FLAG}: {where} is not YAML ({str(e).splitlines()[0]})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{FLAG}: {where} must hold a mapping of flag names to values, got {type(data).__name__}")
    from furlong.cli_flags import _command_fields
    from furlong.miles_flags import refusal_line
    fields: dict[str, tuple[str, dataclasses.Field]] = {}
    for attr, f in _command_fields(command):
        for name in [f.name, *(a.lstrip("-").replace("-", "_") for a in f.metadata.get("aliases", []))]:
            fields[name] = (attr, f)
    for key, value in data.items():
        if key == "custom_config_path" or str(key) not in fields:
            why = (refusal_line("--" + str(key).replace("_", "-")) if key != "custom_config_path"
                   else "a flag file cannot name another")
            raise ValueError(f"{FLAG}: {where}: key {key!r}: " + (why or f"not a flag of furlong {command}"))
        attr, f = fields[key]
        dest = f"{attr}.{f.name}"
        value = _convert(value, f, where, key)   # checked even when the command line overrides it
        if not hasattr(ns, dest):   # the command line wins
            setattr(ns, dest, value)
    return ns
