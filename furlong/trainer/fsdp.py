"""FSDP2 wrapping of the decoder (docs/design.md §2 step 6).

`fully_shard` is applied to every decoder layer, then to the root (embeddings,
final norm, LM head). Trainable parameters stay fp32 ("master weights") and sharded;
MixedPrecisionPolicy all-gathers them in `param_dtype` (bf16 on GPU, fp32 on
CPU) for compute and reduce-scatters gradients in fp32. Frozen parameters (LoRA's
base weights, the KL reference copy) never change, so they are stored in `param_dtype`
itself: no fp32 copy, and the same values the cast at all-gather would give.

Gradient reduction is a SUM over ranks, not FSDP's default mean: the losses are
already weighted by the GLOBAL batch size / token count (batching.py), so each
rank's gradient is its share of the global gradient and the shares add up.
We set the divide factor to 1 and force plain SUM collectives (gloo has no
PREMUL_SUM; for NCCL the two are the same at factor 1).

Gathered weights across micro-batches (`reshard_after_forward=False`, the default; flag
--fsdp-reshard-after-forward turns it off): FSDP's default frees each layer's gathered
compute-dtype weights after its forward, gathers them again for its backward, and again for every
micro-batch. furlong keeps them from a layer's first forward of an optimizer step to the step's
last backward (`micro_batch_sync`): one all-gather per layer per optimizer step instead of two per
micro-batch. The cost is one compute-dtype copy of the model per rank (2 bytes/param in bf16),
half of the fp32 unsharded gradients each rank already accumulates between reduce-scatters. After
the step's last backward the layers reshard, so the optimizer updates the sharded fp32 masters
and the next forward gathers the new weights. (At one rank the "all-gather" is the fp32->bf16
copy-in; the saving there is those copies and FSDP's per-layer hook work.)

One code path: the model is wrapped at every world size, including 1
(init_distributed always forms a process group).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch._dynamo
import torch.fx.experimental._config
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)

from furlong.types import DistContext

if TYPE_CHECKING:
    from furlong.trainer.trainer_config import ShardConfig


def compute_dtype(device: torch.device, dtype_flag: str = "auto") -> torch.dtype:
    """The compute dtype from --dtype (trainer, engine and bench): auto = bf16 on GPU, fp32 on CPU."""
    table = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if dtype_flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype_flag not in table:
        raise ValueError(f"--dtype: unknown dtype {dtype_flag!r} (auto, bf16, fp32)")
    return table[dtype_flag]


def prepare_trainer_model(model: nn.Module, ctx: DistContext, shard: ShardConfig) -> nn.Module:
    """A trainer's model (actor, its reference copy, critic) as `shard` says, in place: recompute
    flag, compiled layer blocks, FSDP2, and `forward_packed` routed through FSDP's unshard hooks
    (it is not `__call__`, which FSDP hooks by itself)."""
    model.gradient_checkpointing = shard.gradient_checkpointing
    if compile_enabled(shard.torch_compile, ctx.device):
        compile_layers(model)
    shard_model(model, ctx, compute_dtype(ctx.device, shard.dtype), reshard_after_forward=shard.reshard_after_forward,
                cpu_offload=shard.cpu_offload)
    register_fsdp_forward_method(model, "forward_packed")
    return model


def shard_model(model: nn.Module, ctx: DistContext, param_dtype: torch.dtype, *, reshard_after_forward: bool,
                reduce_dtype: torch.dtype = torch.float32, cpu_offload: bool = False) -> nn.Module:
    """Shard `model` (any dtype and device) in place over all ranks of `ctx`; returns it.

    `model` must have a `.layers` ModuleList of decoder layers.
    """
    if not hasattr(model, "layers"):
        raise ValueError("shard_model: model has no .layers ModuleList of decoder layers")
    model.to(device=ctx.device)
    with torch.no_grad():   # fp32 masters for what trains, the compute dtype for what is frozen (docstring)
        for p in model.parameters():
            p.data = p.data.to(torch.float32 if p.requires_grad else param_dtype)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    # cast_forward_inputs=False: the layers' floating inputs are the bf16 hidden state (already in
    # param_dtype from the embedding) and the fp32 RoPE cos/sin, which must stay fp32: RoPE is computed
    # in fp32 as in the engine, and torch 2.11's FSDP skipped the input cast during activation
    # recompute, so a cast made --gradient-checkpointing fail its saved-vs-recomputed dtype check.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    # CPU offload: the shards live in (pinned, on CUDA: faster copies) CPU memory; on a CPU run the same
    # policy is a placement no-op, which lets the CPU tests check the offloaded step's arithmetic
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")} if cpu_offload else {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra)
    # the root keeps embeddings/norm/head gathered after forward: its backward
    # follows right away and it would be re-gathered otherwise
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **extra)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            set_sum_reduction(m)
    return model


def micro_batch_sync(model: FSDPModule, k: int, num_micro_batches: int, reshard_after_forward: bool) -> None:
    """Before micro-batch k of an optimizer step: gradients are reduce-scattered only after the last
    one (until then each rank accumulates unsharded gradients); without reshard-after-forward the
    gathered weights also stay until the last one's backward (module docstring)."""
    last = k == num_micro_batches - 1
    model.set_requires_gradient_sync(last)
    if not reshard_after_forward:
        model.set_reshard_after_backward(last)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered layer (FSDPModule.reshard is not recursive): after a no-grad forward,
    which has no backward to reshard, so that memory is freed and named_parameters() are the
    sharded fp32 DTensors again (weight sync and checkpoints read those)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def set_sum_reduction(module: FSDPModule) -> None:
    """Make FSDP reduce gradients by plain SUM over ranks (see module docstring)."""
    module.set_gradient_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


# the layers' compiled graphs kept before Dynamo falls back to eager (compile_layers)
LAYER_RECOMPILE_LIMIT = 64


def compile_enabled(flag: str, device: torch.device) -> bool:
    """--torch-compile: auto compiles on CUDA only (CPU runs are small and compile time dominates)."""
    return flag == "on" or (flag == "auto" and device.type == "cuda")


def compile_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer's forward, attention included (before sharding).

    One graph per layer: RMSNorm, the q/k/v projections, qk-norm and RoPE, the packed attention
    (a single op either way, models/attention.py), the o-projection, residuals and the SwiGLU MLP;
    the norms, RoPE, SiLU and residual adds fuse into a few kernels, forward and backward. Eager
    RoPE alone took about 0.4 s of a 2 s seed train step on the H200 (BENCHMARKS.md). One graph
    rather than two around an eager attention call halves the compiled calls, guard checks and
    autograd nodes per layer: the host's work for the seed step went from ~0.6 s to 0.40-0.53 s,
    against ~1.2 s of GPU work (H200, BENCHMARKS.md). Only the instance's forward is replaced,
    so parameter names stay the same (no `_orig_mod.` prefix for checkpoints and weight sync) and
    FSDP's hooks run eagerly around it.
    Every layer runs the same code, so the layers share one code object and its cache of graphs.
    dynamic=True: micro-batch token counts change every time.

    Each compiled forward runs under two Dynamo settings of its own (thread-local patches, entered
    around every call, the backward's recompute on the autograd thread included, so nothing else in
    the process changes; ~16 us a call on this project's 2-core CI machine, ~2 ms a seed step by
    arithmetic: 28 layers x 5 micro-batches):
    - recompile_limit LAYER_RECOMPILE_LIMIT instead of torch's 8: graphs accumulate per grad mode,
      per recompute (checkpoint's saved-tensor hooks, FSDP's hooks), per input that is or is not a
      view and per size seen first, and the memory plan's probes (4 sizes x 2 modes, twice when
      resharding is turned on) reached 8 on a Qwen3-8B run. Past the limit Dynamo runs the layer
      eagerly, and a recompute that ran eagerly where its forward had run compiled saves different
      tensors: torch.utils.checkpoint's CheckpointError, in set-up.
    - no duck shaping: a token count equal to a model dimension (a 4096-token probe on Qwen3-8B's
      4096 hidden size) would share that dimension's symbol and be specialised with it to a static
      graph; with it off the first call compiles the dynamic graph every later size reuses.
    """
    settings = (torch._dynamo.config.patch(recompile_limit=LAYER_RECOMPILE_LIMIT),
                torch.fx.experimental._config.patch(use_duck_shape=False))
    for layer in model.layers:
        fn = torch.compile(layer.forward, dynamic=True)
        for patch in settings:
            fn = patch(fn)       # a ContextDecorator: entered around each call
        layer.forward = fn
