"""The frozen reference model of a KL term (--use-kl-loss, --kl-coef): where its weights come from.

In order: on a resume under --ref-update-interval N after the first update, the actor's weights of the
last update (the --load run's iter_K, K the largest multiple of N it has done: what the uninterrupted run
holds then; miles instead starts again from --ref-load); else --ref-load, an HF folder (miles' FSDP
reading) or a furlong --save directory (its latest iteration, or --ref-ckpt-step's); else the initial
weights (the actor copies its own model, as before). A Megatron torch_dist directory (what miles' Megatron
recipes pass) is refused with one line naming the HF folder to give instead. Every source is checked
against the --hf-checkpoint model's parameter names and shapes before anything is written.

Where it lives (--ref-placement, ref_on_cpu): on the GPU, a bf16 copy sharded like the actor costs 2 bytes
per parameter per rank for the whole run (8 GB at Qwen3-4B on one GPU, which the trainer's token budget
then lacks). On the CPU its bf16 shards sit in pinned memory and FSDP2's offload policy copies each layer
to the GPU when the reference pass first reaches it; the layers stay gathered for the pass's later
micro-batches (reshard_after_forward=False) and are freed at its end, so a pass copies the weights once
(one H2D of 2 bytes per parameter per step: 8 GB at 4B; bench part `ref` measured a reference pass of
the 4B seed step at 2.20 s against 2.09 s resident, with 7.5 GiB less held on the GPU: an H100,
2026-12-05) and the GPU holds the copy only while
the pass runs, when no activations for a backward are alive. Auto picks the CPU when the copy would take
more than 1/20 of the GPU's memory, or when the actor itself is offloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.checkpoint.verify import TRACKER, iteration_path, latest_iteration

if TYPE_CHECKING:
    import torch

    from furlong.checkpoint.verify import CheckpointChoice
    from furlong.config import Config
    from furlong.models.hf_config import ModelArgs


@dataclass(frozen=True)
class ReferenceSource:
    hf_dir: Path | None            # an HF folder to load, or None
    checkpoint: Path | None        # a furlong --save directory to load (with `iteration`), or None
    iteration: int | None
    what: str                      # for the start-up line

    @property
    def is_initial(self) -> bool:
        return self.hf_dir is None and self.checkpoint is None


INITIAL = ReferenceSource(hf_dir=None, checkpoint=None, iteration=None, what="the initial weights")


def _renamed(e: ValueError, flag: str, step_flag: str) -> ValueError:
    """The checkpoint checks' error, naming this flag (theirs name --load / --ckpt-step, or a file)."""
    text = str(e)
    if not text.startswith("--"):
        return ValueError(f"{flag}: {text}")
    return ValueError(text.replace("--load", flag, 1).replace("--ckpt-step", step_flag, 1))


def _furlong_checkpoint(path: Path, step: int | None, args: ModelArgs, cfg: Config, flag: str,
                        step_flag: str) -> CheckpointChoice:
    from furlong.checkpoint.verify import choose_checkpoint
    from furlong.lora_flags import check_checkpoint_model
    it = step if step is not None else latest_iteration(path)
    if it is not None and iteration_path(path, it).is_dir() and not (iteration_path(path, it) / "trainer.pt").exists():
        raise ValueError(f"{flag}: {path} looks like a Megatron torch_dist checkpoint, which furlong cannot read; "
                         "give the HF folder it was converted from (usually --hf-checkpoint) or a furlong --save "
                         "directory")
    try:
        choice = choose_checkpoint(path, step, None)
        check_checkpoint_model(choice, args, cfg, training=False)   # names and shapes of the --hf-checkpoint model
    except ValueError as e:
        raise _renamed(e, flag, step_flag) from e
    return choice


def check_reference(cfg: Config, args: ModelArgs, resume: CheckpointChoice | None) -> ReferenceSource | None:
    """Where this run's reference comes from (module docstring); None when no KL term needs one."""
    from furlong.models.hf_io import check_pretrained, param_shapes
    a, ref = cfg.algo, cfg.ref
    if not (a.use_kl_loss or a.kl_coef > 0) or cfg.lora.lora_rank > 0:   # LoRA: the base, adapters off
        return None
    n = ref.ref_update_interval
    if n is not None and resume is not None and resume.iteration >= n:
        k = resume.iteration // n * n
        if not iteration_path(cfg.ckpt.load, k).is_dir():
            raise ValueError(f"--ref-update-interval: resuming after iteration {resume.iteration} needs the reference "
                             f"of iteration {k} (the actor's weights then), but {cfg.ckpt.load} has no "
                             f"iter_{k:07d}; save at multiples of {n} (--save-interval)")
        _furlong_checkpoint(Path(cfg.ckpt.load), k, args, cfg, "--load", "--ckpt-step")
        return ReferenceSource(hf_dir=None, checkpoint=Path(cfg.ckpt.load), iteration=k,
                               what=f"the actor of iteration {k} (--ref-update-interval {n})")
    if ref.ref_load is None:
        return INITIAL
    path = Path(ref.ref_load)
    if not path.is_dir():
        raise ValueError(f"--ref-load: {path} is not a directory")
    if (path / TRACKER).exists():
        choice = _furlong_checkpoint(path, ref.ref_ckpt_step, args, cfg, "--ref-load", "--ref-ckpt-step")
        return ReferenceSource(hf_dir=None, checkpoint=path, iteration=choice.iteration,
                               what=f"{choice.path} (--ref-load)")
    if ref.ref_ckpt_step is not None:
        raise ValueError(f"--ref-ckpt-step: {path} is not a furlong --save directory (no {TRACKER})")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ValueError(f"--ref-load: {path} is neither an HF folder (config.json + *.safetensors) nor a furlong "
                         f"--save directory ({TRACKER})")
    try:
        ref_args, _ = check_pretrained(path)
    except ValueError as e:
        raise _renamed(e, "--ref-load", "--ref-ckpt-step") from e
    ours, theirs = param_shapes(args), param_shapes(ref_args)
    if ours != theirs:
        diff = next((k for k in ours if ours[k] != theirs.get(k)), None) or next(k for k in theirs if k not in ours)
        raise ValueError(f"--ref-load: {path} is another model than --hf-checkpoint ({diff}: "
                         f"{theirs.get(diff)} vs {ours.get(diff)})")
    return ReferenceSource(hf_dir=path, checkpoint=None, iteration=None, what=f"{path} (--ref-load)")


REF_GPU_SHARE = 1 / 20   # auto: largest share of one GPU's memory a resident reference may take


def ref_on_cpu(placement: str, num_params: int, world_size: int, device: torch.device,
               actor_offloaded: bool, device_memory_bytes: int | None = None) -> bool:
    """Whether the reference's weights live in CPU memory between passes (module docstring).
    `device_memory_bytes`: the GPU's total memory (default: read from `device`)."""
    if placement != "auto":
        return placement == "cpu"
    if actor_offloaded:
        return True
    if device.type != "cuda":   # nothing to save on a CPU run: "gpu" and "cpu" are the same memory
        return False
    if device_memory_bytes is None:
        import torch
        device_memory_bytes = torch.cuda.get_device_properties(device).total_memory
    return 2 * num_params / world_size > REF_GPU_SHARE * device_memory_bytes


def load_reference(source: ReferenceSource | None, hf_checkpoint: Path, dtype: torch.dtype,
                   device: torch.device) -> torch.nn.Module | None:
    """The unsharded reference model (Actor shards it), or None for the initial weights (Actor copies them)."""
    from furlong.models.hf_io import load_pretrained
    if source is None or source.is_initial:
        return None
    if source.hf_dir is not None:
        return load_pretrained(source.hf_dir, dtype=dtype, device=device)
    from furlong.checkpoint.store import load_model_weights
    model = load_pretrained(hf_checkpoint, dtype=dtype, device=device)
    load_model_weights(source.checkpoint, model, source.iteration)
    return model
