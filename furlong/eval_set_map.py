"""The run's eval sets, from --eval-config or --eval-prompt-data, each setting resolved once.

--eval-config is miles' file (YAML or JSON, or `base64:<payload>` inline):

    eval:                     # optional wrapper: the root itself may be this mapping
      defaults: {n_samples_per_eval_prompt: 4, temperature: 0.6}
      datasets:               # a list of mappings with `name`, or a mapping name -> settings
        - {name: aime, path: /data/aime.jsonl, max_response_len: 8192}
        - {name: gsm8k, path: /data/gsm8k.parquet, rm_type: math, input_key: question}

A set's setting is its own, else `defaults`', else the eval flag's, else the rollout flag's (miles'
order): n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, input_key, label_key,
tool_key, metadata_key; stop and stop_token_ids (default the rollout's), rm_type (a built-in reward
for this set; --custom-rm-path still wins), metadata_overrides (merged into each prompt's metadata).
`${...}` references to other keys of the file resolve as OmegaConf resolves them for miles
(yaml_references.py: absolute and relative key paths, list indices, inside strings). Deviations from
miles: OmegaConf's resolvers (${oc.env:VAR}, ...) are refused with one line, as are an unknown key and
a per-set custom_generate_function_path (miles would fail later or, for the generate function, use
it). --eval-config wins over --eval-prompt-data, as in miles.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.config import Config
from furlong.engine.sampling import SamplingParams
from furlong.yaml_references import resolve_references

FLAG = "--eval-config"
# setting -> (eval flag attribute or None, rollout/data flag attribute): miles' fallback chain
_FALLBACKS = {"n_samples_per_eval_prompt": (("eval", "n_samples_per_eval_prompt"), None),
              "temperature": (("eval", "eval_temperature"), ("rollout", "rollout_temperature")),
              "top_p": (("eval", "eval_top_p"), ("rollout", "rollout_top_p")),
              "top_k": (("eval", "eval_top_k"), ("rollout", "rollout_top_k")),
              "max_response_len": (("eval", "eval_max_response_len"), ("rollout", "rollout_max_response_len")),
              "input_key": (("eval", "eval_input_key"), ("data", "input_key")),
              "label_key": (("eval", "eval_label_key"), ("data", "label_key")),
              "tool_key": (None, ("data", "tool_key")),
              "metadata_key": (None, ("data", "metadata_key")),
              "stop": (None, ("rollout", "rollout_stop")),
              "stop_token_ids": (None, ("rollout", "rollout_stop_token_ids"))}
_OWN = {"name", "path", "rm_type", "metadata_overrides", "min_new_tokens"}   # min_new_tokens: accepted, unused


@dataclass(frozen=True)
class EvalSetConfig:
    name: str                        # metric eval/<name>
    path: str                        # prompt file (.jsonl / .parquet, optional @[a:b])
    input_key: str
    label_key: str | None
    tool_key: str
    metadata_key: str
    sampling: SamplingParams         # seed: --rollout-seed
    n_samples_per_prompt: int
    max_prompt_len: int | None       # --eval-max-prompt-len (else the rollout's), capped by the context
    max_context_len: int | None      # --eval-max-context-len (default --rollout-max-context-len)
    rm_type: str | None = None       # this set's built-in reward (None: the run's)
    metadata_overrides: dict[str, Any] = field(default_factory=dict)


def _load(value: str) -> Any:
    import yaml
    if value.startswith("base64:"):
        try:
            text = base64.b64decode(value[len("base64:"):], validate=True).decode()
        except ValueError as e:
            raise ValueError(f"{FLAG}: the base64: payload does not decode ({e})") from None
    else:
        p = Path(value)
        if not p.is_file():
            raise ValueError(f"{FLAG}: {p} is not a file")
        text = p.read_text()
    try:
        return json.loads(text) if value.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(f"{FLAG}: not valid YAML/JSON: {str(e).splitlines()[0]}") from None


def read_eval_config(value: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(defaults, datasets) of an --eval-config value; ValueError naming the flag for any bad shape."""
    root = _load(value)
    if not isinstance(root, dict):
        raise ValueError(f"{FLAG}: must contain a mapping at the root")
    root = resolve_references(root, FLAG)   # miles reads the file with OmegaConf: ${...} between its keys
    ev = root.get("eval", root)
    if not isinstance(ev, dict):
        raise ValueError(f"{FLAG}: `eval` must be a mapping")
    defaults, raw = ev.get("defaults") or {}, ev.get("datasets")
    if not isinstance(defaults, dict):
        raise ValueError(f"{FLAG}: eval.defaults must be a mapping")
    if isinstance(raw, dict):
        raw = [{"name": name, **(item or {})} for name, item in raw.items()]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{FLAG}: defines no datasets under eval.datasets")
    for i, d in enumerate(raw):
        if not isinstance(d, dict) or "name" not in d or "path" not in d:
            raise ValueError(f"{FLAG}: dataset {i + 1} needs a `name` and a `path`")
        for key in [*d, *defaults]:
            if key == "custom_generate_function_path":
                raise ValueError(f"{FLAG}: dataset {d['name']!r}: a per-set custom_generate_function_path is "
                                 "not supported yet (give --custom-generate-function-path for the whole run)")
            if key not in _FALLBACKS and key not in _OWN:
                raise ValueError(f"{FLAG}: dataset {d['name']!r}: unknown key {key!r} (known: "
                                 f"{', '.join(sorted([*_FALLBACKS, *_OWN]))})")
    names = [str(d["name"]) for d in raw]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise ValueError(f"{FLAG}: two eval sets are named {dup!r}; their results and files would overwrite "
                         "each other")
    return defaults, raw


def _flag(cfg: Config, where: tuple[str, str] | None) -> Any:
    return None if where is None else getattr(getattr(cfg, where[0]), where[1])


def eval_set_configs(cfg: Config, seed: int) -> list[EvalSetConfig]:
    """Every eval set of the run with its settings resolved (module docstring); `seed`: --rollout-seed."""
    if cfg.eval_set.eval_config is not None:
        defaults, raw = read_eval_config(cfg.eval_set.eval_config)
    else:
        defaults, raw = {}, [{"name": n, "path": p} for n, p in cfg.eval_sets()]
    ctx = cfg.eval_set.eval_max_context_len or cfg.rollout.rollout_max_context_len
    max_prompt = (cfg.eval_set.eval_max_prompt_len if cfg.eval_set.eval_max_prompt_len is not None
                  else cfg.data.rollout_max_prompt_len)
    if ctx is not None:   # at least one token of room for the response, as for the rollout
        max_prompt = ctx - 1 if max_prompt is None else min(max_prompt, ctx - 1)
    out = []
    for d in raw:
        v = {k: d[k] if k in d else defaults[k] if k in defaults else
             (_flag(cfg, ev) if _flag(cfg, ev) is not None else _flag(cfg, ro)) for k, (ev, ro) in _FALLBACKS.items()}
        try:
            sampling = SamplingParams(temperature=float(v["temperature"]), top_p=float(v["top_p"]),
                                      top_k=int(v["top_k"]), max_new_tokens=int(v["max_response_len"]),
                                      stop=list(v["stop"]), stop_token_ids=[int(t) for t in v["stop_token_ids"]],
                                      seed=seed)
            n = int(v["n_samples_per_eval_prompt"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{FLAG}: eval set {d['name']!r}: {str(e).split(': ', 1)[-1]}") from None
        if n < 1:
            raise ValueError(f"{FLAG}: eval set {d['name']!r}: n_samples_per_eval_prompt must be >= 1")
        overrides = d.get("metadata_overrides", defaults.get("metadata_overrides")) or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"{FLAG}: eval set {d['name']!r}: metadata_overrides must be a mapping")
        out.append(EvalSetConfig(name=str(d["name"]), path=str(d["path"]), input_key=v["input_key"],
                                 label_key=v["label_key"], tool_key=v["tool_key"], metadata_key=v["metadata_key"],
                                 sampling=sampling, n_samples_per_prompt=n, max_prompt_len=max_prompt,
                                 max_context_len=ctx, rm_type=d.get("rm_type", defaults.get("rm_type")),
                                 metadata_overrides=dict(overrides)))
    return out
