"""Shared-prefix ("cascade") decode attention: a group's prompt KV read once for all its samples.

The n samples of a request are forked from one prefilled prompt (block_manager.fork): the K/V of
their first P tokens are the same (full pages shared, the last partial page copied). Without
cascade, every decode row reads its whole context, the prompt n times per group. With it, the
decode kernel (kernels.py) runs two kinds of program over one launch:
  row program    row b reads only its own tokens [P_b, context_b), split over the KV length;
  group program  group g reads [0, P_g) once, through its first member's block table, for ALL its
                 members' query heads at once (MEMBERS rows x the GQA group fill one 16-row tile of
                 the same shape a row program uses);
and the parts are merged by their log-sum-exp, as flash-decoding merges its splits (the combine
kernel, which a non-cascade step at large batch skips). The arithmetic is that of one softmax over
the row's whole context, regrouped; outputs differ from the single-pass kernel by rounding only.
vLLM and FlashInfer call the same idea cascade attention; unlike them, groups here come from the
fork, not from a prefix hash.

It pays only for long prompts (measured on an H200, per decode step at 128 rows: a 1024-token
prompt 25% faster, 512 12%, 256 even, 128 6% slower): a group's rows run side by side, so the shared
full pages of a short prompt are mostly served from L2 anyway, and the cascade step pays for a combine
pass and the group programs. Hence `min_prefix` (EngineConfig.cascade_min_prefix, 256 tokens): the
seed workload's ~96-token prompts are not grouped; with 8x longer prompts its rollout took 11% less.

Who is grouped (`plan_groups`, plain Python): running rows forked from one prefill (Sequence.fork_group:
a request's n samples, or the requests of a shared prompt, scheduler.py, and their conversations' later
turns, which read the first turn's prompt through the same pages: Sequence.shared_prefix) and never
preempted (a preempted sample is re-prefilled whole into its own pages, so its
prompt K/V are computed again and may differ in the last bits), at most `members` rows per group (a
larger set is cut into several groups); a group needs two rows, a prompt of at least `min_prefix`
tokens, and a free group slot (the kernel's grid holds B // group_splits groups). On the CPU the
engine runs `cascade_attention_reference` (exact, each row's prompt read through its group's first
member's pages), so the CPU tests check the grouping against the no-cache reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from furlong.engine.sequence import Sequence


@dataclass
class PrefixGroups:
    prefix_lens: torch.Tensor    # [B] int32, tokens at a row's start that its group reads (0: not grouped)
    group_rows: torch.Tensor     # [G, M] int32, each group's member rows, -1 padded (all -1: unused slot)
    group_prefix: torch.Tensor   # [G] int32, each group's shared prompt tokens (0: unused slot)

    def rows(self, lo: int, hi: int) -> PrefixGroups:
        """The tables of rows [lo, hi) as staged for them alone (G = B slots: a part staged with its own
        row indices, DecodeInputs.stage)."""
        return PrefixGroups(self.prefix_lens[lo:hi], self.group_rows[lo:hi], self.group_prefix[lo:hi])


class GroupPlan(NamedTuple):
    """Who reads whose prompt in one running set, as host lists (PrefixGroups is its device form)."""
    prefix_lens: list[int]       # [B] tokens at a row's start that its group reads (0: not grouped)
    groups: list[list[int]]      # [G][2..members] each group's rows; the first one's block table is read
    prefixes: list[int]          # [G] each group's shared prompt tokens


def cascade_members(num_heads: int, num_kv_heads: int) -> int:
    """Rows one group program serves: as many as fill its query tile (16 rows, or the next power of
    two above the GQA group); 1 means cascade cannot share anything."""
    group = num_heads // num_kv_heads
    tile = max(16, 1 << (group - 1).bit_length())
    return tile // group


def plan_groups(seqs: list[Sequence], members: int, min_prefix: int = 1, max_groups: int | None = None
                ) -> GroupPlan:
    """The groups of the decode rows `seqs`: groups of 2..members rows whose shared prompt has at least
    `min_prefix` tokens, at most `max_groups` of them (the largest first); rows left out read their whole
    context themselves."""
    by_fork: dict[int, list[int]] = {}
    for row, s in enumerate(seqs):   # decode rows: admitted, so fork_group is set (scheduler._admit)
        if s.num_preemptions == 0 and s.shared_prefix >= max(min_prefix, 1):
            by_fork.setdefault(s.fork_group, []).append(row)
    groups: list[list[int]] = []
    if members >= 2:
        for rows in by_fork.values():
            groups += [rows[i:i + members] for i in range(0, len(rows), members) if len(rows[i:i + members]) > 1]
    if max_groups is not None and len(groups) > max_groups:
        groups = sorted(groups, key=len, reverse=True)[:max_groups]
    prefix_lens = [0] * len(seqs)
    prefixes = []
    for part in groups:
        p = min(seqs[r].shared_prefix for r in part)   # a later turn may hold less of it (retained.py)
        for r in part:
            prefix_lens[r] = p
        prefixes.append(p)
    return GroupPlan(prefix_lens, groups, prefixes)


def no_groups(num_rows: int) -> GroupPlan:
    """Cascade off: every row reads its whole context itself."""
    return GroupPlan([0] * num_rows, [], [])


def group_arrays(plan: GroupPlan, rows: int, members: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A plan as the decode buffers' host arrays over `rows` padded rows:
    (prefix_lens [rows], group_rows [rows, members] -1 padded, group_prefix [rows]), int32."""
    prefix_lens, groups, prefixes = plan
    lens = np.zeros(rows, dtype=np.int32)
    lens[:len(prefix_lens)] = prefix_lens
    table = np.full((rows, members), -1, dtype=np.int32)
    for g, part in enumerate(groups):
        table[g, :len(part)] = part
    pre = np.zeros(rows, dtype=np.int32)
    pre[:len(prefixes)] = prefixes
    return lens, table, pre


def cascade_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                groups: PrefixGroups, key_scales: torch.Tensor | None = None,
                                value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Exact decode attention where row b reads positions < prefix_lens[b] through its group's first
    member's block table and the rest through its own. q [B, Hq, D]; keys/values [P, Hkv, page, D]
    (fp8: dequantised with key/value_scales [P, Hkv, page]) -> [B, Hq, D] (zeros where context_lens
    is 0). One host sync: CPU and tests only."""
    num_rows, page = q.shape[0], keys.shape[2]
    longest = int(context_lens.max()) if num_rows else 0
    if longest == 0:
        return torch.zeros_like(q)
    first = torch.arange(num_rows, device=q.device)                          # [B] table row of the prefix
    for g, p in zip(groups.group_rows.tolist(), groups.group_prefix.tolist()):
        members = [r for r in g if r >= 0]
        if p > 0 and members:
            first[members] = members[0]
    pos = torch.arange(longest, device=q.device)                             # [L]
    own = pos[None, :] >= groups.prefix_lens[:, None].long()                 # [B, L]
    table_row = torch.where(own, torch.arange(num_rows, device=q.device)[:, None], first[:, None])
    pages = block_tables.long()[table_row, pos[None, :] // page]             # [B, L]
    offs = (pos % page)[None, :].expand(num_rows, -1)
    k = keys[pages, :, offs].permute(0, 2, 1, 3)                             # [B, Hkv, L, D]
    v = values[pages, :, offs].permute(0, 2, 1, 3)
    if key_scales is not None:
        k = (k.float() * key_scales[pages, :, offs].transpose(1, 2)[..., None]).to(q.dtype)
        v = (v.float() * value_scales[pages, :, offs].transpose(1, 2)[..., None]).to(q.dtype)
    visible = pos[None, :] < context_lens[:, None].long()
    empty = context_lens == 0
    visible[:, 0] |= empty                    # keep all-masked rows finite; zeroed below
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]
    return out.masked_fill(empty[:, None, None], 0.0)
