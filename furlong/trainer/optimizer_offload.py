"""--optimizer-cpu-offload: AdamW whose two moments live in CPU memory and visit the GPU for the update.

Placement, per trained parameter: the fp32 master weight (4 bytes) and its fp32 gradient (4) stay on the
GPU as FSDP2's sharded DTensors; AdamW's exp_avg and exp_avg_sq (4 + 4) live in page-locked CPU memory,
sharded like the weights (each rank holds the moments of its own shard). The GPU keeps 8 bytes per
parameter instead of 16 and the host 8: Qwen3-8B is 66 GB on each side, where --fsdp-cpu-offload's 16
bytes per parameter on the host (131 GB) do not fit a 128 GiB host.

Algorithm of one step: the moments of all of a rank's shards are one flat fp32 buffer per moment (the
state's tensors are views of it), cut into buckets of `bucket_bytes` of moments (both together, 256 MiB by
default; a bucket may split a parameter). For each bucket, in order: copy its moments in (H2D), run
torch's AdamW update on the bucket's slices of the weights, gradients and moments (the same functional
AdamW torch.optim.AdamW runs: fused on CUDA, as trainer/optimizer.py builds the resident optimizer; the
per-tensor loop on the CPU, torch's default there, so CPU runs match `torch.optim.AdamW()`), copy the
moments back (D2H). On CUDA three device slots and two side streams pipeline this: while bucket i
updates on the current stream, bucket i+1 copies in on one stream and bucket i-1 copies out on the other
(the link is full duplex); events order each slot's copy-in after the copy-out of its previous bucket and
the update between them. On the CPU (tests) the same code runs with plain copies, in order.

Step counts: one per parameter, as AdamW's (bias correction by the parameter's own count, on the device
with the fused kernel, on the CPU otherwise). A parameter split over buckets is updated by each slice with
a copy of its count, and the count itself goes up once. The state is AdamW's ({"step", "exp_avg",
"exp_avg_sq"}, DTensors like the parameters), so torch's get_state_dict/set_state_dict and DCP save and
load it unchanged (checkpoint/store.py) and a checkpoint resumes with or without the flag; loading copies
the moments into the pinned buffers instead of torch's default of moving them to the parameter's device.

Under LoRA only the adapters train, so only their moments move (megabytes): allowed, though it saves little.
The critic of --advantage-estimator ppo takes the same placement (the flag is the trainers' placement).

Megatron's --optimizer-cpu-offload (HybridDeviceOptimizer) keeps a share of the master weights, their
gradients and moments on the CPU and runs that share's update there with a CPU Adam, overlapping the
copies of weights and gradients. We stream only the moments to the GPU instead: the update is a
memory-bound pass (28 bytes per parameter read or written) that the GPU runs ~50x faster than a host's
cores, the masters stay where the forward reads them (no weight copy back each step), and the step needs
8 bytes per parameter of PCIe traffic each way, about 1.3 s for Qwen3-8B at 50 GB/s, against tens of
seconds for a CPU Adam over 8B parameters.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.optim.adam import adam as adam_update

BUCKET_BYTES = 256 * 1024 ** 2   # moments streamed per bucket: exp_avg + exp_avg_sq, fp32 (8 bytes/element)
SLOTS = 3                        # device buffers in flight: bucket i-1 copying out, i updating, i+1 copying in
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Chunk:
    """Elements [start, stop) of parameter `index`'s flattened local shard, at `offset` in its bucket."""
    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """Elements [start, stop) of the flat moment buffers and the parameter slices they belong to."""
    start: int
    stop: int
    chunks: tuple[Chunk, ...]


def plan_buckets(numels: list[int], bucket_elems: int) -> list[Bucket]:
    """Cut parameters of `numels` elements, laid end to end, into buckets of at most `bucket_elems`."""
    if bucket_elems < 1:
        raise ValueError(f"plan_buckets: bucket of {bucket_elems} elements")
    buckets, chunks, begin, pos = [], [], 0, 0
    for i, n in enumerate(numels):
        s = 0
        while s < n:
            take = min(n - s, begin + bucket_elems - pos)
            chunks.append(Chunk(i, s, s + take, pos - begin))
            s, pos = s + take, pos + take
            if pos - begin == bucket_elems:
                buckets.append(Bucket(begin, pos, tuple(chunks)))
                chunks, begin = [], pos
    if chunks:
        buckets.append(Bucket(begin, pos, tuple(chunks)))
    return buckets


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (FSDP2's Shard(0)); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor sharded like `param` (DCP saves each rank's shard under the parameter's name),
    without DTensor.from_local's move onto the mesh's device: the moments stay in CPU memory."""
    spec = getattr(param, "_spec", None)
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor
    return DTensor(local, spec, requires_grad=False)


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` in place. Not pin_memory(): torch's pinned allocator rounds a block up to a power
    of two, which for 33 GB of moments (Qwen3-8B) would reserve 64 GB."""
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    if err != 0:
        raise RuntimeError(f"--optimizer-cpu-offload: cudaHostRegister of {buffer.numel() * 4 / 2**30:.1f} GiB "
                           f"failed (cudaError {err})")


def _unpin(*buffers: torch.Tensor) -> None:
    for b in buffers:   # the references held here keep the memory alive until it is unregistered
        torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


class OffloadedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state with the moments in CPU memory (module docstring). Param groups
    as AdamW's: lr, betas, eps, weight_decay per group; an LR scheduler drives `lr` as usual."""

    def __init__(self, params: Iterable[torch.Tensor] | list[dict], lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float = 0.0, *, fused: bool, bucket_bytes: int = BUCKET_BYTES):
        # AdamW's group keys, so a checkpoint's param groups load into either optimizer
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=True if fused else None,
                        decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.fused = fused
        order = [p for g in self.param_groups for p in g["params"]]
        shards = [_local(p.detach()) for p in order]
        self.device = shards[0].device
        if any(s.device != self.device or s.dtype != torch.float32 for s in shards):
            raise ValueError("--optimizer-cpu-offload: every trained parameter must be an fp32 tensor on one device")
        numels = [s.numel() for s in shards]
        self.buckets = plan_buckets(numels, max(bucket_bytes // 8, 1))
        # the device slots' size: the largest bucket (a model smaller than one bucket needs only its own size)
        self.slot_elems = max((b.stop - b.start for b in self.buckets), default=0)
        total = sum(numels)
        # zeros (calloc: pages appear as the registration touches them); pinned on CUDA for async copies
        self.host = {k: torch.zeros(total, dtype=torch.float32) for k in MOMENTS}
        if self.device.type == "cuda" and total > 0:
            for b in self.host.values():
                _pin(b)
            weakref.finalize(self, _unpin, *self.host.values())
        if self.device.type == "cuda":
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))   # in, out
        step_device = self.device if fused else torch.device("cpu")   # where AdamW keeps `step`
        offset = 0
        for p, s in zip(order, shards):
            n = s.numel()
            self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                             **{k: _like(p, self.host[k][offset:offset + n].view(s.shape)) for k in MOMENTS}}
            offset += n
        # chunk -> position of its parameter in `order`, to take every chunk's step count in one gather
        self._chunk_param = torch.tensor([c.index for b in self.buckets for c in b.chunks], device=step_device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        order = [p for g in self.param_groups for p in g["params"]]
        group_of = [g for g in self.param_groups for _ in g["params"]]
        if not any(p.grad is not None for p in order):
            return loss
        counts = [self.state[p]["step"] for p in order]
        # each chunk its own copy of its parameter's count: the update adds 1 to the copy and reads it
        chunk_steps = torch.stack(counts).index_select(0, self._chunk_param).unbind(0)
        self._stream_buckets(order, group_of, chunk_steps)
        torch._foreach_add_([c for p, c in zip(order, counts) if p.grad is not None], 1.0)
        return loss

    def _stream_buckets(self, order: list[torch.Tensor], group_of: list[dict], chunk_steps) -> None:
        cuda = self.device.type == "cuda"
        slots = [{k: torch.empty(self.slot_elems, dtype=torch.float32, device=self.device) for k in MOMENTS}
                 for _ in range(min(SLOTS, len(self.buckets)))]
        current = torch.cuda.current_stream(self.device) if cuda else None
        copy_in, copy_out = self._streams if cuda else (None, None)
        on = (lambda s: torch.cuda.stream(s)) if cuda else (lambda s: contextlib.nullcontext())
        if cuda:
            # the slots come from the allocator on the current stream, where their last users' kernels may
            # still be queued, and the gradients are the current stream's: the copies start after both
            copy_in.wait_stream(current)
        freed: list[torch.cuda.Event | None] = [None] * len(slots)   # copy-out of the slot's last bucket done
        first = 0
        for i, bucket in enumerate(self.buckets):
            slot, n = slots[i % len(slots)], bucket.stop - bucket.start
            with on(copy_in):
                if freed[i % len(slots)] is not None:
                    copy_in.wait_event(freed[i % len(slots)])
                for k in MOMENTS:
                    slot[k][:n].copy_(self.host[k][bucket.start:bucket.stop], non_blocking=cuda)
            if cuda:
                current.wait_event(copy_in.record_event())
            self._update(bucket, slot, order, group_of, chunk_steps[first:first + len(bucket.chunks)])
            first += len(bucket.chunks)
            with on(copy_out):
                if cuda:
                    copy_out.wait_event(current.record_event())
                for k in MOMENTS:
                    self.host[k][bucket.start:bucket.stop].copy_(slot[k][:n], non_blocking=cuda)
                if cuda:
                    freed[i % len(slots)] = copy_out.record_event()
        if cuda:
            # the one host wait of a step, not one per bucket: the moments' only copy is in host memory,
            # which the CPU may read or write as soon as step() returns (a checkpoint's save, the reset of
            # --reset-optimizer-states, a load), and the slots go back to the allocator on return
            copy_out.synchronize()

    def _update(self, bucket: Bucket, slot: dict[str, torch.Tensor], order: list[torch.Tensor],
                group_of: list[dict], steps) -> None:
        """torch's AdamW on the bucket's slices, one call per param group of the bucket's parameters."""
        by_group: dict[int, tuple[dict, list[list]]] = {}
        for c, step in zip(bucket.chunks, steps):
            p = order[c.index]
            if p.grad is None:   # AdamW skips a parameter without a gradient: weights, moments, count as they are
                continue
            g = group_of[c.index]
            lists = by_group.setdefault(id(g), (g, [[], [], [], [], []]))[1]
            lists[0].append(_local(p).view(-1)[c.start:c.stop])
            lists[1].append(_local(p.grad).reshape(-1)[c.start:c.stop])
            lists[2].append(slot["exp_avg"][c.offset:c.offset + c.stop - c.start])
            lists[3].append(slot["exp_avg_sq"][c.offset:c.offset + c.stop - c.start])
            lists[4].append(step)
        for g, (params, grads, exp_avgs, exp_avg_sqs, steps_) in by_group.values():
            adam_update(params, grads, exp_avgs, exp_avg_sqs, [], steps_, foreach=False, fused=self.fused,
                        capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
                        decoupled_weight_decay=True, amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1],
                        lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, except that the moments are copied into the pinned buffers (torch would put them on
        the parameters' device: 8 bytes per parameter of GPU memory this optimizer exists to avoid)."""
        order = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(ids) != len(order):
            raise ValueError("loaded optimizer state has another number of parameters "
                             f"({len(ids)}, this optimizer {len(order)})")
        stripped = {}
        for i, p in zip(ids, order):
            entry = dict(state_dict["state"].get(i, {}))
            for k in MOMENTS:
                if k in entry:
                    _local(self.state[p][k]).copy_(_local(entry.pop(k)))
            stripped[i] = entry
        kept = {p: {k: self.state[p][k] for k in MOMENTS} for p in order}
        super().load_state_dict({**state_dict, "state": stripped})
        for p in order:
            self.state[p].update(kept[p])
