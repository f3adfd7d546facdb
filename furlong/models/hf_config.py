"""ModelArgs: the decoder's hyper-parameters, parsed from an HF `config.json`.

One decoder serves the Llama, Qwen2 and Qwen3 families; they differ only in a
few switches, set per `model_type` by the small functions in `_FAMILIES`:
  llama: optional bias on q/k/v/o (`attention_bias`) and on the MLP (`mlp_bias`)
  qwen2: bias on q/k/v always, none on o
  qwen3: per-head RMSNorm on q and k (qk-norm); `attention_bias` on q/k/v/o
Both the transformers-4 layout (`rope_theta`, `rope_scaling`, `torch_dtype`) and
the transformers-5 layout (`rope_parameters`, `dtype`) are read. RoPE is plain or
rescaled by "linear", "llama3" (rope.py: Llama 3.1-3.3 checkpoints) or "yarn" (Qwen's
long-context configs); another scaling type is a ValueError, as are sliding-window
attention and activations other than SiLU.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from furlong.models.rope import SCALING_FIELDS, SCALINGS, RopeScaling

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelArgs:
    model_type: str                  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None   # None: plain RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False           # bias on q/k/v projections
    o_bias: bool = False             # bias on the attention output projection
    mlp_bias: bool = False           # bias on gate/up/down projections (llama mlp_bias)
    qk_norm: bool = False            # qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 4096
    torch_dtype: torch.dtype = torch.float32   # the checkpoint's storage dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)  # the original config.json

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        """Parse an HF config dict; `source` names the file in error messages."""
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r} (key 'model_type'; "
                             f"supported: {sorted(_FAMILIES)})")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"{source}: missing key {key!r}")
            return cfg[key]

        def positive_int(key: str, default: Any = None) -> int:
            value = cfg.get(key, default) if default is not None else need(key)
            if value is None:
                value = default
            # bool is an int subclass, and "1024" is not a number: both are config mistakes
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
            return value

        def positive_float(key: str, default: float) -> float:
            value = cfg.get(key)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{source}: key {key!r} must be a positive number, got {value!r}")
            return float(value)

        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (key 'hidden_act'; only silu)")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported (key 'use_sliding_window')")
        hidden, heads = positive_int("hidden_size"), positive_int("num_attention_heads")
        head_dim = positive_int("head_dim", hidden // heads) if cfg.get("head_dim") is not None else hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"{source}: unsupported dtype {dtype_name!r} (key 'torch_dtype')")
        args = cls(
            model_type=model_type,
            vocab_size=positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size"),
            num_layers=positive_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=positive_int("num_key_value_heads", heads) if cfg.get("num_key_value_heads") else heads,
            head_dim=head_dim,
            rope_theta=_rope_theta(cfg, source),
            rope_scaling=_rope_scaling(cfg, source),
            rms_norm_eps=positive_float("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
            max_position_embeddings=(positive_int("max_position_embeddings")
                                     if cfg.get("max_position_embeddings") is not None else 4096),
            torch_dtype=_DTYPES[dtype_name],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=copy.deepcopy(cfg),
        )
        _FAMILIES[model_type](args, cfg)
        if args.num_heads % args.num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {args.num_kv_heads} (key 'num_key_value_heads')")
        return args

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        """Read `<path>/config.json`."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{cfg_path}: config.json not found")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object of model settings, got a {type(cfg).__name__}")
        return cls.from_hf_config(cfg, source=str(cfg_path))

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """An HF config dict for these args: the original config with our fields written over it."""
        cfg = copy.deepcopy(self.hf_config)
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        dtype_name = {v: k for k, v in _DTYPES.items()}[dtype or self.torch_dtype]
        cfg.update(
            architectures=[arch[self.model_type]], model_type=self.model_type,
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
            bos_token_id=self.bos_token_id,
            eos_token_id=(self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                          else (self.eos_token_ids or None)),
            dtype=dtype_name, torch_dtype=dtype_name,
        )
        # Write RoPE both ways so transformers 4 and 5 read the same theta and scaling.
        scaling = _scaling_fields(self.rope_scaling)
        cfg["rope_theta"] = self.rope_theta
        cfg["rope_scaling"] = scaling
        cfg["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        if self.model_type in ("llama", "qwen3"):
            cfg["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        return cfg


def _scaling_block(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(key, block) of the config's RoPE scaling that is not plain, if any: transformers 5 keeps it in
    rope_parameters, 4 in rope_scaling (both may be written; they then agree)."""
    for key in ("rope_parameters", "rope_scaling"):
        block = cfg.get(key)
        if block is not None and block.get("rope_type", block.get("type", "default")) not in (None, "default"):
            return key, block
    return None


def _rope_scaling(cfg: dict[str, Any], source: str) -> RopeScaling | None:
    """The config's RoPE rescaling (rope.py), or None for plain RoPE; rejects the ones not implemented."""
    found = _scaling_block(cfg)
    if found is None:
        return None
    key, block = found
    kind = block.get("rope_type", block.get("type"))
    if kind not in SCALINGS:
        raise ValueError(f"{source}: unsupported RoPE scaling type {kind!r} (key {key!r}; "
                         f"supported: default, {', '.join(SCALINGS)})")

    def number(name: str, default: float | None = None) -> float:
        value = block.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{source}: {key}.{name} must be a positive number for {kind!r} RoPE, got {value!r}")
        return value

    if kind == "linear":
        return RopeScaling("linear", float(number("factor")))
    if kind == "yarn":
        for name in ("mscale", "mscale_all_dim"):
            if block.get(name) is not None:
                raise ValueError(f"{source}: {key}.{name} (DeepSeek's YaRN attention factor) is not supported")
        truncate = block.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{source}: {key}.truncate must be true or false, got {truncate!r}")
        original = block.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        fast, slow = float(number("beta_fast", 32.0)), float(number("beta_slow", 1.0))
        if fast <= slow:
            raise ValueError(f"{source}: {key}.beta_fast ({fast}) must exceed beta_slow ({slow})")
        attention = block.get("attention_factor")
        return RopeScaling("yarn", float(number("factor")),
                           original_max_position_embeddings=int(number("original_max_position_embeddings", original)),
                           beta_fast=fast, beta_slow=slow, truncate=truncate,
                           attention_factor=None if attention is None else float(number("attention_factor")))
    low, high = float(number("low_freq_factor")), float(number("high_freq_factor"))
    if high <= low:
        raise ValueError(f"{source}: {key}.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    return RopeScaling("llama3", float(number("factor")), low, high, int(number("original_max_position_embeddings")))


def _scaling_fields(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """A RopeScaling as config.json writes it (None for plain RoPE)."""
    if scaling is None:
        return None
    fields = {name: getattr(scaling, name) for name in SCALING_FIELDS[scaling.rope_type]}
    return {"rope_type": scaling.rope_type, **{k: v for k, v in fields.items() if v is not None}}


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    """RoPE base (the scaling, if any, is _rope_scaling's)."""
    params = cfg.get("rope_parameters")
    # transformers 5 writes "rope_theta": null next to rope_parameters; 4 has no rope_parameters.
    theta = (params or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
    return float(theta)


def _llama(args: ModelArgs, cfg: dict[str, Any]) -> None:
    args.qkv_bias = args.o_bias = bool(cfg.get("attention_bias", False))
    args.mlp_bias = bool(cfg.get("mlp_bias", False))


def _qwen2(args: ModelArgs, cfg: dict[str, Any]) -> None:
    args.qkv_bias = True


def _qwen3(args: ModelArgs, cfg: dict[str, Any]) -> None:
    args.qkv_bias = args.o_bias = bool(cfg.get("attention_bias", False))
    args.qk_norm = True


# model_type -> family switches (the one place families differ).
_FAMILIES: dict[str, Callable[[ModelArgs, dict[str, Any]], None]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3,
}
