"""Static (preallocated) KV cache for batched generation with left-padded prompts.

Layout: per layer one key and one value buffer [B, Hkv, max_len, D], allocated
once. Every row writes its new tokens at the same slot offset (prompts are
left-padded to a common length, so slot t is decode step t for every row);
a key-validity mask [B, max_len] marks pad slots invalid. The attention mask
handed back to the model is

    mask[b, 0, i, j] = (valid[b, j] and j <= offset + i) or j == offset + i

i.e. valid keys, causal — plus each query always sees its own slot. That last
term only matters for pad queries (a left-pad position has no valid key at or
before it): without it their softmax row would be all -inf, SDPA would return
NaN, and the NaN would reach real rows through the next layer's values
(0 * NaN = NaN in the attention-weighted sum).

Protocol (the model's attention layers call `update`):
  * `begin_step(new_valid [B, T])` (optional) declares which of the T new
    tokens are real; without it all are real. The mask is built once here and
    shared by all layers.
  * `update(layer_idx, k, v)` with roped k, v [B, Hkv, T, D] writes them at
    slots [offset, offset+T) and returns (keys, values, mask) over the first S
    slots, S = offset+T rounded up to a multiple of `bucket` (capped at max_len).
  * The write offset advances by T automatically after the LAST layer's update,
    so a plain `model(ids, pos, kv_cache=cache)` call is one step.

Shapes: keys/values/mask are views of the preallocated buffers — no growing
concatenation. S only changes every `bucket` slots, so each decode step within
a bucket has identical shapes (what CUDA graphs need); `bucket=max_len` makes
S constant for the whole generation, at the cost of attending over unused
(masked) slots.
"""
from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str, bucket: int = 64):
        if max_len < 1 or batch_size < 1 or num_layers < 1:
            raise ValueError(f"StaticKVCache: bad sizes (layers={num_layers}, batch={batch_size}, max_len={max_len})")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # [B, max_len]
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.max_len = max_len
        self.bucket = max(1, bucket)
        self.device = torch.device(device)
        self.offset = 0                     # slots [0, offset) hold keys of earlier steps
        self._step_len: int | None = None   # T of the step begun by begin_step
        self._mask: torch.Tensor | None = None   # [B, 1, T, S] bool for the current step
        self._slot_ids = torch.arange(max_len, device=device)  # [max_len]

    def reset(self) -> None:
        """Forget all tokens (buffers are reused; stale keys are masked by `valid`)."""
        self.offset = 0
        self.valid.zero_()
        self._step_len = None
        self._mask = None

    def attend_len(self, num_new: int) -> int:
        """S: slots attended over when `num_new` tokens are written at the current offset."""
        end = self.offset + num_new
        return min(self.max_len, -(-end // self.bucket) * self.bucket)

    def begin_step(self, new_valid: torch.Tensor) -> None:
        """Declare the next T tokens; new_valid [B, T] bool, False = left-pad slot."""
        if new_valid.dim() != 2 or new_valid.shape[0] != self.batch_size:
            raise ValueError(f"StaticKVCache.begin_step: new_valid must be [B={self.batch_size}, T], "
                             f"got {tuple(new_valid.shape)}")
        num_new = new_valid.shape[1]
        if self.offset + num_new > self.max_len:
            raise ValueError(f"StaticKVCache: {self.offset}+{num_new} tokens exceed max_len {self.max_len}")
        start = self.offset
        self.valid[:, start:start + num_new] = new_valid.to(self.device, torch.bool)
        size = self.attend_len(num_new)
        slots = self._slot_ids[:size]                                  # [S]
        query_slots = self._slot_ids[start:start + num_new]            # [T]
        causal = slots[None, :] <= query_slots[:, None]                # [T, S]
        own = slots[None, :] == query_slots[:, None]                   # [T, S]
        mask = (self.valid[:, None, :size] & causal[None]) | own[None]  # [B, T, S]
        self._mask = mask[:, None]                                     # [B, 1, T, S]
        self._step_len = num_new

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] for this step; return keys/values [B, Hkv, S, D] and mask [B,1,T,S]."""
        num_new = k.shape[2]
        if self._step_len is None:
            self.begin_step(torch.ones(self.batch_size, num_new, dtype=torch.bool, device=self.device))
        elif self._step_len != num_new:
            raise ValueError(f"StaticKVCache.update: layer {layer_idx} got {num_new} tokens, "
                             f"begin_step declared {self._step_len}")
        start, size = self.offset, self.attend_len(num_new)
        self.keys[layer_idx][:, :, start:start + num_new] = k
        self.values[layer_idx][:, :, start:start + num_new] = v
        mask = self._mask
        if layer_idx == self.num_layers - 1:
            self.offset += num_new
            self._step_len = None
            self._mask = None
        return self.keys[layer_idx][:, :, :size], self.values[layer_idx][:, :, :size], mask

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` [B'] (ascending indices): finished sequences stop costing
        attention and memory. Layer by layer, so the extra memory is one layer's live part."""
        if self._step_len is not None:
            raise ValueError("StaticKVCache.keep_rows: not between begin_step and the last layer's update")
        for layer in range(self.num_layers):
            self.keys[layer] = self.keys[layer].index_select(0, rows)
            self.values[layer] = self.values[layer].index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.batch_size = int(rows.numel())
