"""The LoRA flags' checks (config.LoraFlags; config_map.lora_config maps them to models.lora.LoraConfig),
and what a LoRA run's checkpoint holds.

--lora-rank 0 (the default, as in miles) is full-parameter training; >= 1 trains adapters on a
frozen base. --lora-alpha is a float here (miles: int; peft takes either). --target-modules
defaults to all-linear (miles: unset). Whether the named modules exist is checked when the
model is built (lora_names.resolve_targets), with the same one-line ValueError.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from furlong.models.lora_names import parse_target_modules

if TYPE_CHECKING:
    from furlong.config import Config
    from furlong.models.lora import LoraConfig
    from furlong.models.hf_config import ModelArgs
    from furlong.checkpoint.verify import CheckpointChoice


def check_lora_flags(cfg: Config) -> None:
    """ValueError('--flag: why') for a bad LoRA flag value."""
    c = cfg.lora
    if c.lora_rank < 0:
        raise ValueError(f"--lora-rank: must be >= 0 (0: full-parameter training), got {c.lora_rank}")
    if c.lora_rank == 0:
        return
    if not c.lora_alpha > 0:
        raise ValueError(f"--lora-alpha: must be > 0, got {c.lora_alpha}")
    if not 0 <= c.lora_dropout < 1:
        raise ValueError(f"--lora-dropout: must be in [0, 1), got {c.lora_dropout}")
    parse_target_modules(c.target_modules)


def checkpoint_shapes(args: ModelArgs, spec: LoraConfig | None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of what a run's checkpoint holds: every parameter, or with LoRA only the adapters
    (built on the meta device: nothing allocated)."""
    import torch

    from furlong.models.decoder import Transformer
    from furlong.models.hf_io import param_shapes
    from furlong.models.lora import adapter_state_dict, apply_lora
    from furlong.models.lora_names import resolve_targets
    if spec is None:
        return param_shapes(args)
    with torch.device("meta"):
        model = Transformer(args)
        apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    return {k: tuple(t.shape) for k, t in adapter_state_dict(model).items()}


def check_checkpoint_model(choice: CheckpointChoice, args: ModelArgs, cfg: Config, training: bool) -> None:
    """ValueError (one line) unless the checkpoint `--load` chose holds what this run expects: for a
    training run the model of --hf-checkpoint with this run's adapters (the LoRA flags must agree with
    the checkpoint's), for `furlong eval` whatever the checkpoint records (full or adapters)."""
    from furlong.checkpoint.verify import shape_mismatch
    from furlong.checkpoint.lora import lora_config_of
    from furlong.config_map import lora_config
    saved = lora_config_of(choice.trainer_state)
    spec = lora_config(cfg) if training else saved
    if training and (saved is None) != (spec is None):
        what = "LoRA adapters" if saved is not None else "full-parameter weights"
        raise ValueError(f"--lora-rank: {choice.path} holds {what}; resume it with "
                         + (f"--lora-rank {saved.rank}" if saved is not None else "--lora-rank 0"))
    if training and spec is not None:
        for flag, ours, theirs in (("--lora-rank", spec.rank, saved.rank), ("--lora-alpha", spec.alpha, saved.alpha),
                                   ("--lora-dropout", spec.dropout, saved.dropout),
                                   ("--target-modules", spec.target_modules, saved.target_modules)):
            if ours != theirs:
                show = lambda v: ",".join(v) if isinstance(v, tuple) else v  # noqa: E731
                raise ValueError(f"{flag}: {choice.path} was trained with {flag} {show(theirs)}, not {show(ours)}")
    mismatch = shape_mismatch(choice.path, checkpoint_shapes(args, spec))
    if mismatch is not None:
        raise ValueError(f"--load: {choice.path} is a checkpoint of another model: {mismatch}")
