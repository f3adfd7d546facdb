"""Prefill over a cached prefix: a continued conversation's new tokens attend to the KV its pages hold.

A continuation (retained.py) prefills tokens at positions start .. start+n-1 of a sequence whose
first `start` tokens are already in its pages. Each layer writes the new tokens' K/V into their
slots first (as PrefillContext does), then gathers the sequence's whole K/V, positions
0 .. start+n-1, out of the paged cache into one packed [K, Hkv, D] row and runs causal attention
with queries [n] against keys [start+n], aligned at the end: query j sees keys 0 .. start+j.

  CUDA (bf16/fp16)  aten's flash-attention varlen forward with separate query and key boundaries
                    (its causal mask is bottom-right aligned when the key segment is longer).
  elsewhere         scaled_dot_product_attention per segment with the explicit mask: the reference.

The gather copies the cached prefix once per layer per turn: reading K/V that is already there,
which costs a fraction of recomputing it (a prefill of the prefix runs every matmul of every layer).
Items that start at 0 (new prompts packed into the same prefill) take the same path over their own keys.

fp8 KV cache (kv_fp8.py): the gathered prefix is dequantised (kv_fp8.dequantize, the scales
gathered beside the data), and the new tokens' own rows are then overwritten with their unquantised
k/v, so a prefill attends over its own tokens unquantised whether it starts at 0 or past a cached
prefix (as PrefillContext does), and an item's result does not depend on what shares its prefill.
Every cached token is read as the stored fp8, as a decode step reads it. A reused conversation
therefore computes what the fp8 engine computes had it kept decoding, not what a re-prefill of the
whole conversation computes (that one attends over the unquantised K/V of every earlier turn, whose
hidden states differ too): token for token equal to the former, close to the latter
(tests/test_engine_multiturn_fp8.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from furlong.engine.host_copy import to_device
from furlong.engine.kv_cache import PrefillContext
from furlong.engine.kv_fp8 import dequantize
from furlong.models.attention import _has_flash

if TYPE_CHECKING:
    from furlong.engine.plan import PrefillItem


@dataclass
class PrefixPrefillContext:
    new: PrefillContext          # the new tokens: their slots (written first), query boundaries cu_seqlens [N+1]
    key_page: torch.Tensor       # [K] int64, page of each key slot (every item's positions 0 .. start+n-1)
    key_offset: torch.Tensor     # [K] int64
    cu_keys: torch.Tensor        # [N+1] int32, key segment boundaries
    max_keys: int                # longest key segment
    query_bounds: list[int]      # [N+1] host copy of new.cu_seqlens (reference path)
    key_bounds: list[int]        # [N+1] host copy of cu_keys
    new_keys: torch.Tensor       # [T] int64, the key row of each new token (fp8: its unquantised k/v go there)

    def keys(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v [T, Hkv, D] to their slots, then every item's keys and values [K, Hkv, D]
        (an fp8 cache's rows dequantised, the new tokens' own rows unquantised: module docstring)."""
        self.new.cache.write(layer, self.new.page, self.new.offset, k, v)
        c = self.new.cache.layer(layer)
        at = (self.key_page, slice(None), self.key_offset)
        kk, vv = c.keys[at], c.values[at]
        if c.key_scales is not None:
            kk, vv = dequantize(kk, c.key_scales[at], k.dtype), dequantize(vv, c.value_scales[at], v.dtype)
            kk[self.new_keys], vv[self.new_keys] = k, v
        return kk, vv

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kk, vv = self.keys(layer, k, v)
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _has_flash():
            return torch.ops.aten._flash_attention_forward(
                q, kk, vv, self.new.cu_seqlens, self.cu_keys, self.new.max_seqlen, self.max_keys, 0.0, True, False,
                scale=q.shape[-1] ** -0.5)[0]
        return prefix_attention_reference(q, kk, vv, self.query_bounds, self.key_bounds)


def prefix_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_bounds: list[int],
                               key_bounds: list[int]) -> torch.Tensor:
    """q [T, Hq, D], k/v [K, Hkv, D]; segment i's queries are the LAST positions of its keys, so query j
    of a segment with n queries and m keys sees keys 0 .. m-n+j. Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    for i in range(len(query_bounds) - 1):
        qa, qb, ka, kb = query_bounds[i], query_bounds[i + 1], key_bounds[i], key_bounds[i + 1]
        n, m = qb - qa, kb - ka
        mask = torch.arange(m, device=q.device)[None, :] <= torch.arange(m - n, m, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1),
                                           v[ka:kb].transpose(0, 1), attn_mask=mask,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out[qa:qb] = o.transpose(0, 1)
    return out


def prefix_prefill_context(new: PrefillContext, items: list[PrefillItem], device: torch.device
                           ) -> PrefixPrefillContext:
    """The prefix-reading context of a prefill whose items may start past 0 (`new`: its plain context)."""
    size = new.cache.page_size
    pages, offsets, bounds = [], [], [0]
    for item in items:
        table, total = item.sequences[0].block_table, item.start + len(item.token_ids)
        pages.extend(table[i // size] for i in range(total))
        offsets.extend(i % size for i in range(total))
        bounds.append(bounds[-1] + total)
    as_t = lambda x, dt=torch.int64: to_device(x, dt, device)  # noqa: E731
    query_bounds, new_keys = [0], []
    for item, key_end in zip(items, bounds[1:]):
        query_bounds.append(query_bounds[-1] + len(item.token_ids))
        new_keys.extend(range(key_end - len(item.token_ids), key_end))    # the last n keys of its segment
    return PrefixPrefillContext(new=new, key_page=as_t(pages), key_offset=as_t(offsets),
                                cu_keys=as_t(bounds, torch.int32),
                                max_keys=max(b - a for a, b in zip(bounds[:-1], bounds[1:])),
                                query_bounds=query_bounds, key_bounds=bounds, new_keys=as_t(new_keys))
