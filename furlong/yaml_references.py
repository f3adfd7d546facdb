"""`${...}` references between the keys of one YAML/JSON file (--eval-config), the part of OmegaConf's
interpolation that miles' reader (OmegaConf.to_container(resolve=True)) gives a config file, without
OmegaConf itself (not a furlong dependency).

Supported, with OmegaConf's meaning:
  ${a.b.c}          the value at that key path from the file's root; list items by index: ${a.list.0.x}
                    or ${a.list[0].x}
  ${.x}  ${..x}     relative: a key beside the one that holds the reference; each further dot goes up
                    one level
  whole value       a value that is just one reference takes the referenced value with its type (a
                    number stays a number, a mapping is copied); inside a longer string the value is
                    written with str() ("${root}/aime.jsonl")
  \\${x}             a literal "${x}"
References may lead to values that hold references themselves. Not supported, each refused with one
line naming the flag and the key: resolvers (${oc.env:HOME}, ${oc.select:...}: any ${...} with a
colon), nested references (${a.${b}}), a mapping or list inside a longer string (OmegaConf would
write its repr there), and cycles. A key that does not exist is one line too (OmegaConf raises then
as well).
"""
from __future__ import annotations

import re
from typing import Any

_REF = re.compile(r"(\\)?\$\{([^{}]*)\}")   # group 1: the escape; group 2: the reference
Path = tuple[Any, ...]                       # keys and list indices from the root


def resolve_references(root: Any, flag: str) -> Any:
    """A copy of `root` (parsed YAML/JSON) with every `${...}` resolved (module docstring); ValueError
    '<flag>: <key path>: why' otherwise."""
    return _Resolver(root, flag).value((), root)


def _where(path: Path) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "the root"


class _Resolver:
    def __init__(self, root: Any, flag: str) -> None:
        self.root, self.flag = root, flag
        self.active: list[Path] = []   # string values being resolved, innermost last (cycle check)

    def fail(self, path: Path, why: str) -> ValueError:
        return ValueError(f"{self.flag}: {_where(path)}: {why}")

    def value(self, path: Path, v: Any) -> Any:
        if isinstance(v, dict):
            return {k: self.value((*path, k), x) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value((*path, i), x) for i, x in enumerate(v)]
        if isinstance(v, str) and "${" in v:
            return self._string(path, v)
        return v

    def _string(self, path: Path, s: str) -> Any:
        if path in self.active:
            chain = " -> ".join(_where(p) for p in [*self.active[self.active.index(path):], path])
            raise self.fail(path, f"references form a cycle ({chain})")
        matches = list(_REF.finditer(s))
        refs = [m for m in matches if not m.group(1)]
        if s.count("${") != len(matches):
            raise self.fail(path, f"{s!r}: a nested or unclosed ${{...}} (only plain key references are supported)")
        self.active.append(path)
        try:
            if len(refs) == 1 and refs[0].span() == (0, len(s)):
                return self._target(path, refs[0].group(2))

            def text(m: re.Match) -> str:
                if m.group(1):
                    return "${" + m.group(2) + "}"
                t = self._target(path, m.group(2))
                if isinstance(t, (dict, list)):
                    raise self.fail(path, f"${{{m.group(2)}}} is a {type(t).__name__}, which cannot be part of "
                                          f"the string {s!r}")
                return str(t)
            return _REF.sub(text, s)
        finally:
            self.active.pop()

    def _target(self, path: Path, ref: str) -> Any:
        if ":" in ref:
            raise self.fail(path, f"${{{ref}}}: resolvers (oc.env, ...) are not supported, only references to "
                                  "other keys of the file")
        dots = len(ref) - len(ref.lstrip("."))
        if dots > len(path):
            raise self.fail(path, f"${{{ref}}} goes above the root of the file")
        keys = [k for k in re.split(r"[.\[\]]", ref[dots:]) if k]
        if not keys:
            raise self.fail(path, f"${{{ref}}} names no key")
        target: Path = (*path[:len(path) - dots], *keys) if dots else tuple(keys)
        node, resolved = self.root, []
        for k in target:
            key = self._step(node, k)
            if key is None:
                raise self.fail(path, f"${{{ref}}}: the file has no key {_where((*resolved, k))}")
            resolved.append(key)
            node = node[key]
        return self.value(tuple(resolved), node)

    @staticmethod
    def _step(node: Any, k: Any) -> Any:
        """The key or index of `node` that `k` (text from the reference) names, or None."""
        if isinstance(node, dict):
            if k in node:
                return k
            if isinstance(k, str) and k.lstrip("-").isdigit() and int(k) in node:   # YAML's integer keys
                return int(k)
            return None
        if isinstance(node, list):
            i = k if isinstance(k, int) else int(k) if isinstance(k, str) and k.isdigit() else None
            return i if i is not None and i < len(node) else None
        return None
