"""The paged KV cache and the two attention contexts (prefill, decode) of the engine's forward.

Layout: keys and values each [num_pages, num_layers, Hkv, page_size, D]. Pages
come first so that a layer's view (`keys[:, layer]`) starts at the same address
whatever the number of pages: the cache can be re-mapped with another size
under the same CUDA graphs (stable_memory.py). A token's slot is (page, offset);
a sequence's pages are its block table. Page 0 is the scratch page padded rows
write into (block_manager.py).

The engine's forward (forward.py) calls `ctx.attend(layer, q, k, v)` with
roped q [N, Hq, D] and k, v [N, Hkv, D], one row per token; the context
writes k, v into the cache and returns the attention output [N, Hq, D]:

  PrefillContext  N packed new tokens of several sequences (cu_seqlens): each
                  attends causally within its own segment (packed_attention,
                  varlen on CUDA), and its k/v go to their slots. Prefill always
                  starts a sequence at position 0 (new prompts, or a preempted
                  sequence recomputed whole), so no cached prefix is read.
  DecodeContext   one token per sequence: the new k/v go to the row's slot, then the row
                  attends over its first context_lens[b] cached tokens through
                  its block table: the Triton kernel on CUDA (kernels.py, GQA
                  without copying K/V, split over the KV length for small
                  batches), an exact gather + SDPA reference elsewhere. With
                  `prefix` groups (cascade.py) a group's shared prompt is read
                  once for all its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from furlong.engine.cascade import PrefixGroups, cascade_attention_reference
from furlong.models.attention import packed_attention


class PagedKVCache:
    """keys/values [P, L, Hkv, page_size, D] (P pages may exceed those backed by memory: only
    the pages the block manager hands out are ever touched)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.page_size = keys.shape[3]

    @staticmethod
    def page_shape(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, ...]:
        return (num_layers, num_kv_heads, page_size, head_dim)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys, values: [P, Hkv, page_size, D] strided views."""
        return self.keys[:, layer], self.values[:, layer]

    def write(self, layer: int, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] into slots (page[i], offset[i]), i < N (a Triton kernel on CUDA)."""
        keys, values = self.layer(layer)
        if keys.is_cuda:
            from furlong.engine.kernels import store_kv
            store_kv(keys, values, page, offset, k, v)
            return
        keys[page, :, offset] = k
        values[page, :, offset] = v

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer): the forked samples' private last pages."""
        if not src:
            return
        s = torch.tensor(src, device=self.keys.device)
        d = torch.tensor(dst, device=self.keys.device)
        self.keys[d] = self.keys[s]
        self.values[d] = self.values[s]


@dataclass
class PrefillContext:
    cache: PagedKVCache
    page: torch.Tensor          # [T] int64, page of each packed token's slot
    offset: torch.Tensor        # [T] int64, offset within that page
    cu_seqlens: torch.Tensor    # [N+1] int32
    max_seqlen: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.page, self.offset, k, v)
        return packed_attention(q, k, v, self.cu_seqlens, self.max_seqlen)


@dataclass
class DecodeContext:
    cache: PagedKVCache
    page: torch.Tensor          # [B] int64, slot of the new token
    offset: torch.Tensor        # [B] int64
    block_tables: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens incl. the new one (0: padded row, output 0)
    num_splits: int             # KV-length splits of the Triton kernel
    use_triton: bool
    prefix: PrefixGroups | None = None   # cascade: rows forked from one prompt read its KV once (cascade.py)
    group_splits: int = 1                # cascade: KV-length splits of each group's prefix

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.page, self.offset, k, v)
        keys, values = self.cache.layer(layer)
        if self.use_triton:
            from furlong.engine.kernels import paged_decode_attention
            return paged_decode_attention(q, keys, values, self.block_tables, self.context_lens, self.num_splits,
                                          prefix=self.prefix, group_splits=self.group_splits)
        if self.prefix is not None:
            return cascade_attention_reference(q, keys, values, self.block_tables, self.context_lens, self.prefix)
        return decode_attention_reference(q, keys, values, self.block_tables, self.context_lens)


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [num_pages, Hkv, page, D] -> [B, Hq, D], exact: every row's pages
    gathered into one padded [B, Hkv, L, D] batch, one SDPA masked to each row's context (a padded
    row, context 0, gives zeros). One host sync (the longest context): CPU and tests only."""
    num_rows, page = q.shape[0], keys.shape[2]
    longest = int(context_lens.max()) if num_rows else 0
    if longest == 0:
        return torch.zeros_like(q)
    pages = block_tables[:, :-(-longest // page)].long()                    # [B, mp]
    gather = lambda c: c[pages].permute(0, 2, 1, 3, 4).flatten(2, 3)        # noqa: E731  [B, Hkv, mp*page, D]
    k, v = gather(keys), gather(values)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None].long()   # [B, L]
    empty = context_lens == 0
    visible[:, 0] |= empty                    # keep all-masked rows finite; zeroed below
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]
    return out.masked_fill(empty[:, None, None], 0.0)
