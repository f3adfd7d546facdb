"""The decode step's inputs: static device buffers a CUDA graph reads, staged from the host per window.

A captured graph reads fixed addresses, so a decode step reads its inputs from buffers made once for
the largest batch (R rows) and rewritten in place before each window; the step itself advances ids
and positions on the device (model_runner.py). The per-row integers share one int64 buffer and the
per-row floats one float32 buffer (rows named by INT_ROWS / FLOAT_ROWS), so staging a window is one
host-to-device copy per buffer. Rows past the running ones are padding: position 0, scratch page 0,
no group.

Staging reuses host arrays: the sampling rows and the cascade group tables are rebuilt only when the
running set (its key) changed, block-table rows only where a table grew; ids and positions are
rewritten every window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from furlong.engine.cascade import GroupPlan, PrefixGroups, group_arrays
from furlong.engine.host_copy import to_device
from furlong.engine.sampling import SamplingRows
from furlong.engine.sequence import Sequence

INT_ROWS = ("input_ids", "positions", "seed32", "top_k", "greedy")   # rows of DecodeInputs.ints
FLOAT_ROWS = ("inv_temperature", "top_p")                          # rows of DecodeInputs.floats
INT_ROW = {name: i for i, name in enumerate(INT_ROWS)}
FLOAT_ROW = {name: i for i, name in enumerate(FLOAT_ROWS)}


class HostSamplingRows(NamedTuple):
    """Each sequence's sampling inputs as host lists, [B] each."""
    seed32: list[int]
    top_k: list[int]             # the vocabulary size where top-k is off
    greedy: list[int]            # 1 where temperature is 0
    inv_temperature: list[float]   # 1.0 for greedy rows (their log-prob is at T = 1)
    top_p: list[float]


def host_sampling_rows(seqs: list[Sequence], vocab_size: int) -> HostSamplingRows:
    ps = [s.params for s in seqs]
    return HostSamplingRows(seed32=[s.seed32 for s in seqs], top_k=[p.top_k if p.top_k > 0 else vocab_size for p in ps],
                            greedy=[int(p.temperature == 0) for p in ps],
                            inv_temperature=[1.0 / p.temperature if p.temperature > 0 else 1.0 for p in ps],
                            top_p=[p.top_p for p in ps])


def sampling_rows(seqs: list[Sequence], vocab_size: int, positions: list[int], device: torch.device
                  ) -> SamplingRows:
    """SamplingRows of `seqs` drawing the tokens at `positions` [B] (the prefill's first tokens)."""
    h = host_sampling_rows(seqs, vocab_size)
    ints = to_device([h.seed32, h.top_k, h.greedy, positions], torch.int64, device)    # [4, B]
    floats = to_device([h.inv_temperature, h.top_p], torch.float32, device)            # [2, B]
    return SamplingRows(inv_temperature=floats[0], greedy=ints[2] != 0, top_k=ints[1], top_p=floats[1],
                        seed32=ints[0], positions=ints[3])


@dataclass
class StepInputs:
    """Views of the first r buffer rows: what one decode step reads, advances and writes."""
    input_ids: torch.Tensor      # [r] int64, each row's input token (advanced to the sampled one)
    positions: torch.Tensor      # [r] int64, its position (advanced by 1)
    seed32: torch.Tensor         # [r] int64
    top_k: torch.Tensor          # [r] int64
    greedy: torch.Tensor         # [r] int64, nonzero: greedy
    inv_temperature: torch.Tensor   # [r] float32
    top_p: torch.Tensor          # [r] float32
    block_tables: torch.Tensor   # [r, max_pages] int32
    groups: PrefixGroups         # cascade tables, [r] slots
    out_tokens: torch.Tensor     # [r] int64, the step's sampled tokens
    out_log_probs: torch.Tensor  # [r] float32

    def sampling(self, positions: torch.Tensor) -> SamplingRows:
        """The rows' SamplingRows drawing the tokens at `positions` [r]."""
        return SamplingRows(inv_temperature=self.inv_temperature, greedy=self.greedy != 0, top_k=self.top_k,
                            top_p=self.top_p, seed32=self.seed32, positions=positions)


class DecodeInputs:
    def __init__(self, rows: int, max_pages: int, members: int, device: torch.device):
        self.ints = torch.zeros(len(INT_ROWS), rows, dtype=torch.int64, device=device)       # [5, R]
        self.floats = torch.ones(len(FLOAT_ROWS), rows, dtype=torch.float32, device=device)  # [2, R]
        self.block_tables = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)  # [R, max_pages]
        # cascade groups (cascade.PrefixGroups), one slot per row: the kernel reads rows // group_splits
        self.prefix_lens = torch.zeros(rows, dtype=torch.int32, device=device)               # [R]
        self.group_rows = torch.full((rows, members), -1, dtype=torch.int32, device=device)  # [R, members]
        self.group_prefix = torch.zeros(rows, dtype=torch.int32, device=device)              # [R]
        self.out_tokens = torch.zeros(rows, dtype=torch.int64, device=device)                # [R]
        self.out_log_probs = torch.zeros(rows, dtype=torch.float32, device=device)           # [R]
        self.members = members
        self._key = None          # running set whose inputs the buffers hold

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    def step_inputs(self, rows: int) -> StepInputs:
        i = {name: self.ints[row, :rows] for name, row in INT_ROW.items()}
        f = {name: self.floats[row, :rows] for name, row in FLOAT_ROW.items()}
        return StepInputs(**i, **f,
                          block_tables=self.block_tables[:rows],
                          groups=PrefixGroups(self.prefix_lens[:rows], self.group_rows[:rows],
                                              self.group_prefix[:rows]),
                          out_tokens=self.out_tokens[:rows], out_log_probs=self.out_log_probs[:rows])

    def clear(self, rows: int) -> None:
        """Padded-row state in the first `rows` rows (before a graph capture); staging starts anew."""
        self.ints[:, :rows].zero_()
        self.block_tables[:rows].zero_()
        self.prefix_lens[:rows].zero_()
        self.group_rows[:rows].fill_(-1)
        self.group_prefix[:rows].zero_()
        self._key = None

    def forget(self) -> None:
        """Stage everything anew at the next window (a new session, or the buffers were overwritten)."""
        self._key = None

    def stage(self, seqs: list[Sequence], rows: int, key: tuple, groups: list[tuple[int, GroupPlan]],
              vocab_size: int) -> None:
        """Write the window's inputs for `seqs` into the first `rows` buffer rows; `key` names the
        running set (it changes when any row's sequence does), `groups` is its cascade plan as (first
        row, plan) parts, each plan's rows and group slots within its part (the next part's first row,
        or `rows`, ends it)."""
        num = len(seqs)
        if key != self._key:
            self._key = key
            self._host_ints = np.zeros((len(INT_ROWS), rows), dtype=np.int64)        # [5, rows]
            self._host_floats = np.ones((len(FLOAT_ROWS), rows), dtype=np.float32)   # [2, rows]
            self._host_tables = np.zeros((rows, self.max_pages), dtype=np.int32)     # [rows, max_pages]
            self._table_lens = [0] * num                                             # pages staged per row
            h = host_sampling_rows(seqs, vocab_size)
            for name in ("seed32", "top_k", "greedy"):
                self._host_ints[INT_ROW[name], :num] = getattr(h, name)
            for name in FLOAT_ROWS:
                self._host_floats[FLOAT_ROW[name], :num] = getattr(h, name)
            self.floats[:, :rows].copy_(torch.from_numpy(self._host_floats))
            ends = [lo for lo, _ in groups[1:]] + [rows]
            for (lo, plan), hi in zip(groups, ends):
                for buf, host in zip((self.prefix_lens, self.group_rows, self.group_prefix),
                                     group_arrays(plan, hi - lo, self.members)):
                    buf[lo:hi].copy_(torch.from_numpy(host))
        for i, s in enumerate(seqs):
            n = len(s.block_table)
            if n != self._table_lens[i]:
                self._host_tables[i, self._table_lens[i]:n] = s.block_table[self._table_lens[i]:]
                self._table_lens[i] = n
        self._host_ints[INT_ROW["input_ids"], :num] = [s.token_ids[-1] for s in seqs]
        self._host_ints[INT_ROW["positions"], :num] = [s.num_tokens - 1 for s in seqs]
        self.ints[:, :rows].copy_(torch.from_numpy(self._host_ints))
        self.block_tables[:rows].copy_(torch.from_numpy(self._host_tables))
