"""A prefill launch: one packed varlen forward over the new tokens of several sequences (ModelRunner.run).

Each item's tokens sit at positions start.. of its first sequence; their K/V slots come from that
sequence's block table. A continuation (start > 0) also attends to its cached prefix
(prefix_prefill.py). Logits are taken only at each item's last position, the items' page copies
(a forked sample's copy of the last partial page) follow the forward, and every sequence samples its
first new token; an item's n samples share its last position's logits. Nothing is waited for: the
host tensors go up through host_copy.py, and the caller's one sync reads the tokens back.
"""
from __future__ import annotations

from typing import Callable

import torch

from furlong.engine.decode_inputs import sampling_rows
from furlong.engine.forward import EngineForward
from furlong.engine.host_copy import to_device
from furlong.engine.kv_cache import PagedKVCache, PrefillContext
from furlong.engine.plan import PrefillItem
from furlong.engine.prefix_prefill import prefix_prefill_context
from furlong.engine.sampling import SamplingRows

Sampler = Callable[[torch.Tensor, SamplingRows, bool], tuple[torch.Tensor, torch.Tensor]]


def launch_prefill(items: list[PrefillItem], cache: PagedKVCache, forward: EngineForward, sample: Sampler,
                   page_size: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log_probs) [N] on the device: the first new token of each of the items' N sequences."""
    ids, pos, pages, offs, cu = [], [], [], [], [0]
    for item in items:
        table = item.sequences[0].block_table
        n, start = len(item.token_ids), item.start
        ids.extend(item.token_ids)
        pos.extend(range(start, start + n))
        pages.extend(table[i // page_size] for i in range(start, start + n))
        offs.extend(i % page_size for i in range(start, start + n))
        cu.append(cu[-1] + n)
    as_t = lambda x, dt=torch.int64: to_device(x, dt, device)  # noqa: E731
    ctx = PrefillContext(cache, as_t(pages), as_t(offs), as_t(cu, torch.int32),
                         max(b - a for a, b in zip(cu[:-1], cu[1:])))
    if any(item.start for item in items):
        ctx = prefix_prefill_context(ctx, items, device)
    hidden = forward.hidden(as_t(ids), as_t(pos), ctx.attend)                          # [T, H]
    logits = forward.logits(hidden[as_t(cu[1:]) - 1])                                  # [N items, V]
    copies = [c for item in items for c in item.page_copies]
    cache.copy_pages([a for a, _ in copies], [b for _, b in copies])
    seqs = [s for item in items for s in item.sequences]
    reps = as_t([len(item.sequences) for item in items])
    logits = logits.repeat_interleave(reps, dim=0, output_size=len(seqs))   # output_size: no sync
    positions = [item.start + len(item.token_ids) for item in items for _ in item.sequences]
    rows = sampling_rows(seqs, vocab_size, positions, device)
    return sample(logits, rows, any(s.params.truncates for s in seqs))
