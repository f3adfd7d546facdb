"""Will the CPU side of --fsdp-cpu-offload or --optimizer-cpu-offload fit in this machine's memory? Checked
before the trainer is built.

Full-parameter training with FSDP2's CPU offload keeps, per parameter and in CPU memory, the fp32 master
weight (4 bytes), its fp32 gradient (4) and AdamW's two fp32 moments (8): 16 bytes, sharded over the ranks,
so the ranks on one host hold 16 x params x local ranks / ranks between them (Qwen3-8B alone: 131 GB). A
reference model placed on the CPU (--ref-placement) adds its bf16 shards (2 bytes). Under LoRA only the
adapters are trained: their 16 bytes per parameter, and the frozen base's shards in the compute dtype.

--optimizer-cpu-offload keeps only AdamW's two fp32 moments in CPU memory: 8 bytes per trained parameter,
sharded the same way (Qwen3-8B alone: 66 GB); masters, gradients and a LoRA base stay on the GPU. Its
reference counts on the host unless --ref-placement gpu (auto may place it either side; the check takes
the larger).

A ppo run's critic is built with the actor's sharding flags, so under either flag its state is offloaded
the same way: its decoder (no lm_head) and value head, all trained in fp32, at the same bytes per parameter.

Why a check: past what the host has, the kernel ends the process with SIGKILL (the Qwen3-8B shape on a
128 GiB device machine, 2026-12-05: exit 137 about two minutes in, before the first step, no message).
A run that would need more than MemAvailable stops before anything is built, with one line naming the
flag and the numbers. Pages the OS can reclaim (the page cache) count as available, as the kernel's
MemAvailable counts them; swap does not count.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from furlong.config import Config
    from furlong.models.hf_config import ModelArgs

GIB = 1024 ** 3
TRAINED_BYTES = 16         # fp32 master weight + fp32 gradient + AdamW's exp_avg and exp_avg_sq, per parameter
MOMENT_BYTES = 8           # --optimizer-cpu-offload: AdamW's exp_avg and exp_avg_sq (fp32), per trained parameter
HEADROOM = 1.05            # pinned staging buffers, allocator slack, the Python process itself


def offload_host_bytes(num_params: int, num_trainable: int, frozen_bytes_per_param: int, ref_bytes_per_param: int,
                       world_size: int, local_world_size: int, trained_bytes_per_param: int = TRAINED_BYTES) -> int:
    """CPU bytes the ranks on this host hold: trained parameters at trained_bytes_per_param (16 under
    --fsdp-cpu-offload, MOMENT_BYTES under --optimizer-cpu-offload), the frozen rest (LoRA's base) at
    frozen_bytes_per_param, a CPU reference at ref_bytes_per_param (0: none), all sharded evenly over
    world_size ranks, local_world_size of which share this host."""
    per_param = (num_trainable * trained_bytes_per_param + (num_params - num_trainable) * frozen_bytes_per_param
                 + num_params * ref_bytes_per_param)
    return int(per_param * HEADROOM * local_world_size / world_size)


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """The kernel's MemAvailable, or None where there is no /proc/meminfo (not Linux) or it lacks the line."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024          # kB
    return None


def check_offload_fits(needed: int, available: int | None, num_params: int, lora: bool,
                       flag: str = "--fsdp-cpu-offload") -> None:
    """Raise ValueError naming `flag` when `needed` bytes exceed `available` (None: unknown, pass)."""
    if available is None or needed <= available:
        return
    hint = ("run on more hosts (torchrun: the state shards over every rank)" if lora else
            "train LoRA adapters instead (--lora-rank 64: a few bytes per base parameter), or run on more hosts")
    raise ValueError(f"{flag}: the offloaded training state of {num_params / 1e9:.2f}B parameters needs "
                     f"~{needed / GIB:.0f} GiB of CPU memory on this host, {available / GIB:.0f} GiB is available; "
                     f"{hint}")


def critic_num_params(args: ModelArgs) -> int:
    """Parameters of a ppo critic built on the decoder `args` describe: its lm_head is dropped
    (models/value_model.py) and a value head of hidden + 1 added."""
    import math

    from furlong.models.hf_io import param_shapes
    shapes = param_shapes(args)
    shapes.pop("lm_head.weight", None)
    return sum(math.prod(s) for s in shapes.values()) + args.hidden_size + 1


def check_offload_host_memory(cfg: Config, args: ModelArgs, world_size: int, with_reference: bool,
                              compute_bytes: int, critic_args: ModelArgs | None = None) -> None:
    """For a training run under --fsdp-cpu-offload or --optimizer-cpu-offload: ValueError (one line naming the
    flag) when this host's ranks would need more CPU memory than it has available (module docstring);
    compute_bytes: the compute dtype's size (LoRA's frozen base, a CPU reference); critic_args: a ppo
    run's critic decoder (None: no critic). Nothing is allocated (meta-device shapes)."""
    import math

    from furlong.config_map import lora_config
    from furlong.lora_flags import checkpoint_shapes
    from furlong.models.hf_io import param_shapes
    spec = lora_config(cfg)
    num_params = sum(math.prod(s) for s in param_shapes(args).values())
    num_trainable = num_params if spec is None else sum(math.prod(s) for s in checkpoint_shapes(args, spec).values())
    if spec is not None:
        num_params += num_trainable               # param_shapes counts the base only
    # the offloaded actor's reference sits in CPU memory unless --ref-placement gpu keeps it resident
    ref_bytes = compute_bytes if with_reference and cfg.ref.ref_placement != "gpu" else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))   # torchrun's; one host when unset
    # the moments only under --optimizer-cpu-offload: masters, gradients and a LoRA base stay on the GPU
    moments = cfg.parallel.optimizer_cpu_offload
    trained, frozen = (MOMENT_BYTES, 0) if moments else (TRAINED_BYTES, compute_bytes)
    flag = "--optimizer-cpu-offload" if moments else "--fsdp-cpu-offload"
    needed = offload_host_bytes(num_params, num_trainable, frozen, ref_bytes, world_size, local, trained)
    if critic_args is not None:   # full-parameter whatever the actor's LoRA flags (trainer/critic.py)
        num_critic = critic_num_params(critic_args)
        needed += offload_host_bytes(num_critic, num_critic, 0, 0, world_size, local, trained)
        num_params += num_critic
    check_offload_fits(needed, mem_available_bytes(), num_params, spec is not None, flag)
