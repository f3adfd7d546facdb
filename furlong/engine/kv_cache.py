"""The paged KV cache and the two attention contexts (prefill, decode) of the engine's forward.

Layout: keys and values each [num_pages, num_layers, Hkv, page_size, D]. Pages
come first so that a layer's view (`keys[:, layer]`) starts at the same address
whatever the number of pages: the cache can be re-mapped with another size
under the same CUDA graphs (stable_memory.py). A token's slot is (page, offset);
a sequence's pages are its block table. Page 0 is the scratch page padded rows
write into (block_manager.py). With an fp8 cache (kv_fp8.py) each (page, layer,
head) block of page_size x D fp8 values is followed by its page_size fp32
scales (`KVLayout`): both are strided views of one byte buffer per K and V, so
a page, scales included, is still the unit that is allocated, shared and copied.
An fp8 V block is stored dim-major ([D, page]; `KVLayout.dim_major`): the views
keep the [page, D] shape, so only the Triton kernels see the difference.

The engine's forward (forward.py) calls `ctx.attend(layer, q, k, v)` with
roped q [N, Hq, D] and k, v [N, Hkv, D], one row per token; the context
writes k, v into the cache and returns the attention output [N, Hq, D]:

  PrefillContext  N packed new tokens of several sequences (cu_seqlens): each
                  attends causally within its own segment (packed_attention,
                  varlen on CUDA), and its k/v go to their slots. It starts a
                  sequence at position 0 (new prompts, or a preempted sequence
                  recomputed whole), so no cached prefix is read (and with an
                  fp8 cache the prompt attends over its unquantised k/v; only
                  later reads see the stored fp8). A continued conversation's
                  prefill reads its cached prefix: prefix_prefill.py.
  DecodeContext   one token per sequence: the new k/v go to the row's slot (on CUDA its
                  attend_qkv takes the QKV projection instead and one kernel, store_kernels.
                  decode_prologue, norms, ropes and stores them), then the row
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
from furlong.engine.host_copy import to_device
from furlong.engine.kv_fp8 import SCALE_BYTES, quantize
from furlong.models.attention import packed_attention


@dataclass(frozen=True)
class KVLayout:
    """Bytes of the paged K (or V) buffer: pages outermost, each [L, Hkv] blocks of page_size x D
    values, each block followed by its page_size fp32 scales when `scaled` (fp8)."""
    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype           # stored element dtype (the model's, or float8_e4m3fn)
    scaled: bool                 # a fp32 scale per (token, head) beside the data

    @property
    def block_bytes(self) -> int:
        """One (page, layer, head) block: data, then scales."""
        return self.page_size * (self.head_dim * self.dtype.itemsize + (SCALE_BYTES if self.scaled else 0))

    @property
    def page_bytes(self) -> int:
        """One page of K (or of V), every layer."""
        return self.num_layers * self.num_kv_heads * self.block_bytes

    def dim_major(self, values: bool) -> bool:
        """Whether a block's data is stored [D, page] (its [page, D] view strided (1, page)): an fp8
        cache's values. The decode kernel's P.V dot reduces over a V tile's tokens; Triton 3.6 has no
        transposing shared-memory load for 8-bit operands, so a token-major fp8 V tile reaches the
        tensor cores one byte per load (128 LDS.U8 and their byte permutes per thread per tile in the
        sm_90 SASS, a third of the loop's instructions); dim-major it is read like a K tile."""
        return values and self.scaled

    def views(self, buf: torch.Tensor, num_pages: int,
              values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """buf: uint8, at least num_pages * page_bytes -> (data [P, L, Hkv, page, D] in dtype, scales
        [P, L, Hkv, page] float32 or None), strided views of buf; `values`: the V buffer (dim_major)."""
        raw = buf[:num_pages * self.page_bytes]
        size = self.dtype.itemsize
        per = self.block_bytes // size           # elements per block
        lh = (self.num_layers * self.num_kv_heads, self.num_kv_heads)
        data = raw.view(self.dtype)
        inner = (1, self.page_size) if self.dim_major(values) else (self.head_dim, 1)    # (token, dim) strides
        data = data.as_strided((num_pages, self.num_layers, self.num_kv_heads, self.page_size, self.head_dim),
                               (lh[0] * per, lh[1] * per, per, *inner), data.storage_offset())
        if not self.scaled:
            return data, None
        f32 = raw.view(torch.float32)
        per = self.block_bytes // SCALE_BYTES
        first = self.page_size * self.head_dim * size // SCALE_BYTES     # the scales follow the data
        scales = f32.as_strided((num_pages, self.num_layers, self.num_kv_heads, self.page_size),
                                (lh[0] * per, lh[1] * per, per, 1), f32.storage_offset() + first)
        return data, scales


def value_layout(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """keys/values [num_pages, Hkv, page, D] (one layer's views) -> whether values is dim-major (else
    laid out as keys, which must be token-major with D contiguous)."""
    page = keys.shape[2]
    if keys.stride(-1) != 1 or values.stride()[:2] != keys.stride()[:2]:
        raise ValueError("KV cache: head dim must be contiguous in keys, and values paged like keys")
    if values.stride() == keys.stride():
        return False
    if values.stride()[2:] == (1, page):
        return True
    raise ValueError(f"KV cache: values strides {values.stride()} are neither keys' {keys.stride()} nor dim-major")


@dataclass
class KVLayer:
    """One layer's cache: keys/values [P, Hkv, page_size, D], their scales [P, Hkv, page_size]
    float32 with an fp8 cache (else None); strided views."""
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None


class PagedKVCache:
    """keys/values [P, L, Hkv, page_size, D], with key/value scales [P, L, Hkv, page_size] for fp8
    (P pages may exceed those backed by memory: only the pages the block manager hands out are
    ever touched)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, key_scales: torch.Tensor | None = None,
                 value_scales: torch.Tensor | None = None):
        self.keys, self.values = keys, values
        self.key_scales, self.value_scales = key_scales, value_scales
        self.page_size = keys.shape[3]

    @staticmethod
    def page_shape(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, ...]:
        return (num_layers, num_kv_heads, page_size, head_dim)

    def layer(self, layer: int) -> KVLayer:
        scaled = self.key_scales is not None
        return KVLayer(self.keys[:, layer], self.values[:, layer], self.key_scales[:, layer] if scaled else None,
                       self.value_scales[:, layer] if scaled else None)

    def write(self, layer: int, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] into slots (page[i], offset[i]), i < N, quantised for an fp8 cache (a Triton
        kernel on CUDA)."""
        c = self.layer(layer)
        if c.keys.is_cuda:
            from furlong.engine.store_kernels import store_kv
            store_kv(c.keys, c.values, page, offset, k, v, c.key_scales, c.value_scales)
            return
        if c.key_scales is None:
            c.keys[page, :, offset] = k
            c.values[page, :, offset] = v
            return
        for data, scales, x in ((c.keys, c.key_scales, k), (c.values, c.value_scales, v)):
            q, s = quantize(x)
            data[page, :, offset] = q
            scales[page, :, offset] = s

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer, scales too): the forked samples' private last pages."""
        if not src:
            return
        s, d = to_device([src, dst], torch.int64, self.keys.device)     # no sync: a mixed step's prefill
        self.keys[d] = self.keys[s]
        self.values[d] = self.values[s]
        if self.key_scales is not None:
            self.key_scales[d] = self.key_scales[s]
            self.value_scales[d] = self.value_scales[s]

    def zero_page(self, page: int) -> None:
        """Zero one page (the scratch page: padded rows read it, keep it finite)."""
        for t in (self.keys, self.values, self.key_scales, self.value_scales):
            if t is not None:
                t[page].zero_()


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


# an fp8 cache's decode attention kernel, by name (ModelRunner.fp8_kernel): "padded", kernels.py's for every
# launch; "transposed", kernels_transposed.py's for launches without cascade groups (1.06x over the long
# rollout on an H100); "transposed-all" (the engine's default), also a cascade launch's row programs (1.13x
# over the long rollout with 260-596-token prompts, past the cascade threshold, on an H100; BENCHMARKS.md)
FP8_KERNELS = ("padded", "transposed", "transposed-all")


def rows_transposed(fp8_kernel: str, cascade: bool) -> bool:
    """Whether a launch's row programs run kernels_transposed.py's kernel (an fp8 cache's, V dim-major)
    under the kernel name `fp8_kernel`, for a launch with (`cascade`) or without cascade groups."""
    return fp8_kernel == "transposed-all" or (fp8_kernel == "transposed" and not cascade)


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
    fp8_kernel: str = "padded"           # FP8_KERNELS

    def __post_init__(self):
        if self.fp8_kernel not in FP8_KERNELS:
            raise ValueError(f"DecodeContext: fp8_kernel {self.fp8_kernel!r} is none of {FP8_KERNELS}")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.page, self.offset, k, v)
        return self._read(layer, q)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
        """attend() from the fused projection qkv [B, (Hq + 2 Hkv) D] before qk-norm and RoPE (cos/sin
        [B, D]): one Triton kernel norms and ropes q and k and stores k and v (CUDA only)."""
        from furlong.engine.store_kernels import decode_prologue
        c = self.cache.layer(layer)
        q = decode_prologue(qkv, q_norm, k_norm, cos, sin, eps, c.keys, c.values, self.page, self.offset,
                            c.key_scales, c.value_scales)
        return self._read(layer, q)

    def _read(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        c = self.cache.layer(layer)
        scales = dict(key_scales=c.key_scales, value_scales=c.value_scales)
        if self.use_triton:
            from furlong.engine.kernels import paged_decode_attention
            return paged_decode_attention(q, c.keys, c.values, self.block_tables, self.context_lens, self.num_splits,
                                          prefix=self.prefix, group_splits=self.group_splits,
                                          transposed=rows_transposed(self.fp8_kernel, self.prefix is not None),
                                          **scales)
        if self.prefix is not None:
            return cascade_attention_reference(q, c.keys, c.values, self.block_tables, self.context_lens,
                                               self.prefix, **scales)
        return decode_attention_reference(q, c.keys, c.values, self.block_tables, self.context_lens, **scales)


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               key_scales: torch.Tensor | None = None,
                               value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [num_pages, Hkv, page, D] -> [B, Hq, D], exact: every row's pages
    gathered into one padded [B, Hkv, L, D] batch (fp8: dequantised with key/value_scales
    [num_pages, Hkv, page]), one SDPA masked to each row's context (a padded row, context 0, gives
    zeros). One host sync (the longest context): CPU and tests only."""
    num_rows, page = q.shape[0], keys.shape[2]
    longest = int(context_lens.max()) if num_rows else 0
    if longest == 0:
        return torch.zeros_like(q)
    pages = block_tables[:, :-(-longest // page)].long()                    # [B, mp]
    gather = lambda c: c[pages].transpose(1, 2).flatten(2, 3)               # noqa: E731  [B, Hkv, mp*page, ...]
    k, v = gather(keys), gather(values)
    if key_scales is not None:
        k = (k.float() * gather(key_scales)[..., None]).to(q.dtype)
        v = (v.float() * gather(value_scales)[..., None]).to(q.dtype)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None].long()   # [B, L]
    empty = context_lens == 0
    visible[:, 0] |= empty                    # keep all-masked rows finite; zeroed below
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]
    return out.masked_fill(empty[:, None, None], 0.0)
