"""Read and write HF-format checkpoints (config.json + safetensors + tokenizer files).

`check_pretrained` reads only config.json and the safetensors headers: every
expected tensor must be present with the right shape; any unknown tensor is an
error too, except RoPE caches and a tied `lm_head.weight` that some exporters
write; a truncated or garbage file fails its header check (safetensors compares
the header's extent with the file size). All errors are ValueError naming the
file and key, so a run can check its checkpoint before it writes anything.
Loading checks the same plus every tensor's values (NaN/inf refused), builds the Transformer on the
meta device (no memory, no init), casts, materializes it with `to_empty`, then copies each tensor
from the memory-mapped file(s) into place and recomputes the fp32 RoPE frequencies.

Names: ours are the HF names without the "model." prefix. `hf_name` is the one
mapping between the two; everything else here goes through it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs

_OUR_NAME = re.compile(
    r"(embed_tokens\.weight|norm\.weight|lm_head\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)"
    r"|layers\.\d+\.self_attn\.[qk]_norm\.weight"
    r"|layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias))"
)
# Tensors some checkpoints carry that are derived state, never weights.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json")


def hf_name(name: str) -> str:
    """Our parameter name -> the HF checkpoint name ("layers.0.mlp.up_proj.weight" -> "model.layers...")."""
    if not _OUR_NAME.fullmatch(name):
        raise ValueError(f"state dict key {name!r} is not a furlong decoder parameter (unwrap the model first)")
    return name if name.startswith("lm_head.") else "model." + name


def hf_state_dict(model_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> the same tensors under HF names."""
    return {hf_name(k): v for k, v in model_state_dict.items()}


def _tensor_index(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: unreadable weight_map ({e!r})") from None
        files = {k: path / v for k, v in weight_map.items()}
        for key, f in files.items():
            if not f.is_file():
                raise ValueError(f"{f}: shard listed in {index.name} for key {key!r} not found")
        return files
    if single.is_file():
        with _open(single) as f:
            return {k: single for k in f.keys()}
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _open(file: Path):
    """safe_open, with a damaged file (truncated download, not safetensors) as one ValueError naming it."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); truncated or not safetensors?") from None


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, for the decoder `args` describe (meta device: nothing allocated)."""
    with torch.device("meta"):
        return {k: tuple(t.shape) for k, t in Transformer(args).state_dict().items()}


def check_pretrained(path: str | Path) -> tuple[ModelArgs, dict[str, Path]]:
    """ModelArgs and tensor -> file, after checking config.json and every safetensors header against
    the model the config describes (module docstring); no tensor data is read."""
    path = Path(path)
    args = ModelArgs.from_dir(path)
    files = _tensor_index(path)
    shapes = {hf_name(k): shape for k, shape in param_shapes(args).items()}
    where = path / ("model.safetensors.index.json" if (path / "model.safetensors.index.json").is_file()
                    else "model.safetensors")
    for key in shapes:
        if key not in files:
            raise ValueError(f"{where}: missing tensor {key!r}")
    for key in files:
        tied_extra = key == "lm_head.weight" and args.tie_word_embeddings
        if key not in shapes and not tied_extra and not _IGNORED_HF.fullmatch(key):
            raise ValueError(f"{files[key]}: unexpected tensor {key!r} for {args.model_type} config")
    for file in sorted(set(files[k] for k in shapes)):
        with _open(file) as f:
            present = set(f.keys())
            for key in (k for k in shapes if files[k] == file):
                if key not in present:
                    raise ValueError(f"{file}: missing tensor {key!r}")
                got = tuple(f.get_slice(key).get_shape())
                if got != shapes[key]:
                    raise ValueError(f"{file}: tensor {key!r} has shape {got}, config.json implies {shapes[key]}")
    return args, files


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> Transformer:
    """Build the decoder for an HF checkpoint dir and load its weights (eval mode).

    dtype default: the checkpoint's torch_dtype on CUDA, float32 elsewhere.
    device default: cpu.
    """
    args, files = check_pretrained(path)
    device = torch.device(device if device is not None else "cpu")
    if dtype is None:
        dtype = args.torch_dtype if device.type == "cuda" else torch.float32

    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype=dtype).to_empty(device=device)
    targets = {hf_name(k): t for k, t in model.state_dict().items()}   # views of the parameters

    by_file: dict[Path, list[str]] = {}
    for key in targets:
        by_file.setdefault(files[key], []).append(key)
    with torch.no_grad():
        for file, keys in by_file.items():
            with _open(file) as f:
                for key in keys:
                    t = f.get_tensor(key)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):   # one pass per tensor
                        raise ValueError(f"{file}: tensor {key!r} holds NaN or inf values (damaged checkpoint?)")
                    targets[key].copy_(t)
    model.init_rope()
    return model.eval()


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):   # a DTensor shard: gather (collective; every rank must call)
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def save_hf(state_dict_or_model: dict[str, torch.Tensor] | nn.Module, args: ModelArgs,
            out_dir: str | Path, tokenizer_src: str | Path | None = None) -> Path:
    """Write an HF checkpoint dir loadable by transformers: built in a temporary directory, then renamed
    into place (safe_paths.install_checkpoint: into an existing directory only its checkpoint files are
    replaced; the caller has checked the target with safe_paths.check_dir_target).

    Tied embeddings are written once (no lm_head.weight), as transformers does.
    Tokenizer/generation files present in tokenizer_src are copied.
    """
    out_dir = Path(out_dir).resolve()   # a symlink's target receives the checkpoint; the link stays
    sd = state_dict_or_model.state_dict() if isinstance(state_dict_or_model, nn.Module) else state_dict_or_model
    tensors = {k: _to_cpu(v) for k, v in hf_state_dict(sd).items()}
    if args.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if tokenizer_src is not None and not Path(tokenizer_src).is_dir():
        raise ValueError(f"{tokenizer_src}: tokenizer source directory not found")
    float_dtypes = [t.dtype for t in tensors.values() if t.is_floating_point()]
    dtype = float_dtypes[0] if float_dtypes else args.torch_dtype

    from furlong.safe_paths import install_checkpoint, remove_stale_temps, temp_prefix
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)   # left by a save that was killed (its process is gone)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    os.chmod(tmp, 0o755)   # mkdtemp makes it private; a checkpoint dir should not be
    try:
        (tmp / "config.json").write_text(json.dumps(args.to_hf_config(dtype), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_src is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_src) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        install_checkpoint(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
