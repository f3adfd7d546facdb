"""The model runner: owns the engine's tensors and graphs; runs prefills and decode windows.

It owns the KV cache, the decode buffers and the CUDA graphs, and runs the two
kinds of forward the scheduler plans:

  prefill  one packed varlen forward over the new tokens of several sequences
           (eager: its token count changes every time), writing their K/V into
           the cache; logits only at each sequence's last position.
  decode   a window of `window` steps over the running rows, each step one
           token per row. A step reads its inputs from static buffers and, on
           the GPU, advances them itself (sampled token -> next input,
           position + 1), so the host only replays the step's CUDA graph
           `window` times and reads the window's tokens back with ONE sync.
           Graphs are captured per batch-size bucket (rows padded up to the
           bucket; padded rows use the scratch page 0) and per sampler variant
           (plain / top-k-top-p) and attention variant (plain / cascade: rows
           forked from one prompt read its KV once, cascade.py; used when the
           window has such a group), lazily on first use, sharing one memory pool.
On CPU the same step function runs eagerly with the reference attention and
sampler, so CPU tests exercise the scheduling, paging and on-device state
updates that the GPU runs.

The model's weights are used in place: weight sync copies into the same
parameter storage, so captured graphs stay valid. The KV cache is allocated
per generation session and freed after it (the colocated trainer needs the
memory). On CUDA it lives in a StableBuffer (stable_memory.py): its physical
memory is unmapped between sessions while its address stays, so the graphs,
the small decode buffers and the graph pool are kept for the next session.
Without the driver API the cache is a plain allocation and the graphs are
dropped with it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from furlong.engine.cascade import PrefixGroups, cascade_members, group_arrays, plan_groups
from furlong.engine.forward import EngineForward
from furlong.engine.kv_cache import DecodeContext, PagedKVCache, PrefillContext
from furlong.engine.sampling import SamplingRows, row_thresholds, sample_reference
from furlong.engine.scheduler import PrefillItem
from furlong.engine.sequence import Sequence
from furlong.engine.stable_memory import stable_buffer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                 640, 768, 896, 1024)
INT_ROWS = ("input_ids", "positions", "seed32", "top_k", "greedy")   # rows of the int64 decode buffer
FLOAT_ROWS = ("inv_temperature", "top_p")                          # rows of the float32 decode buffer


@dataclass
class StepOutput:
    tokens: list[list[int]]          # [B][window] sampled tokens
    log_probs: list[list[float]]     # [B][window]
    num_grouped_rows: int = 0        # rows that read their prompt's KV through a cascade group


def sampling_rows_host(seqs: list[Sequence], vocab_size: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per-row sampling inputs as host lists, in INT_ROWS / FLOAT_ROWS order (minus ids/positions)."""
    seeds, top_k, greedy, inv_t, top_p = [], [], [], [], []
    for s in seqs:
        p = s.params
        seeds.append(s.seed32)
        top_k.append(p.top_k if p.top_k > 0 else vocab_size)
        greedy.append(int(p.temperature == 0))
        inv_t.append(1.0 / p.temperature if p.temperature > 0 else 1.0)
        top_p.append(p.top_p)
    return [seeds, top_k, greedy], [inv_t, top_p]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, page_size: int, max_num_seqs: int, use_cuda_graphs: bool,
                 compile: bool, cascade: bool = True, cascade_min_prefix: int = 1):
        self.model = model
        self.forward = EngineForward(model, compile=compile)
        self.args = model.args
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.page_size = page_size
        self.on_gpu = self.device.type == "cuda"
        self.use_cuda_graphs = use_cuda_graphs and self.on_gpu
        self.buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.cache: PagedKVCache | None = None
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}   # (rows, truncate, cascade)
        self.cascade = cascade                # may be switched between decode windows (graphs exist for both)
        self.members = cascade_members(self.args.num_heads, self.args.num_kv_heads)   # rows per cascade group
        self.cascade_min_prefix = cascade_min_prefix   # shortest shared prompt worth a group (tokens)
        self.pool = None
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.on_gpu else 1
        self.stable: tuple | None = None      # (keys, values) StableBuffers, reserved on first use
        self.ints = None                      # decode buffers, made on first use (see allocate)
        self.kv_bytes = 0                     # KV cache of the current session
        self._stage_key = None                # running set (serials) whose inputs the buffers hold (_stage)
        self._plan: tuple = (None, [], [], [])  # (running-set key, prefix_lens, group rows, group prefixes)

    # ---- session -------------------------------------------------------------------------------
    def page_shape(self) -> tuple[int, ...]:
        a = self.args
        return PagedKVCache.page_shape(a.num_layers, a.num_kv_heads, self.page_size, a.head_dim)

    def page_bytes(self) -> int:
        """Bytes of one page, keys and values."""
        return 2 * self.dtype.itemsize * torch.Size(self.page_shape()).numel()

    def _views(self, buf: torch.Tensor, num_pages: int) -> torch.Tensor:
        return buf.view(self.dtype)[:num_pages * torch.Size(self.page_shape()).numel()].view(num_pages,
                                                                                          *self.page_shape())

    def allocate(self, num_pages: int, max_pages_per_seq: int) -> None:
        dev, rows = self.device, self.buckets[-1]
        if self.on_gpu and self.stable is None:
            total = torch.cuda.get_device_properties(dev).total_memory
            k = stable_buffer(dev, total)
            self.stable = (k, stable_buffer(dev, total)) if k is not None else ()
        if self.stable:
            half = num_pages * self.page_bytes() // 2
            for buf in self.stable:
                buf.map(half)
            max_pages = self.stable[0].max_bytes // (self.page_bytes() // 2)
            self.cache = PagedKVCache(*(self._views(buf.tensor, max_pages) for buf in self.stable))
        else:
            self.graphs.clear()
            self.pool = None
            # zeros: the CPU reference attention reads whole pages (masked), and a NaN bit pattern
            # left in never-written memory would survive the mask (NaN * 0)
            shape = (num_pages, *self.page_shape())
            self.cache = PagedKVCache(torch.zeros(shape, dtype=self.dtype, device=dev),
                                      torch.zeros(shape, dtype=self.dtype, device=dev))
        self.kv_bytes = num_pages * self.page_bytes()
        self.cache.keys[0].zero_()     # the scratch page: padded rows read it, keep it finite
        self.cache.values[0].zero_()
        self._stage_key = None                # serials restart with the session's scheduler
        self._plan = (None, [], [], [])
        if self.ints is None or self.block_tables.shape[1] != max_pages_per_seq:
            self.graphs.clear()
            self.ints = torch.zeros(len(INT_ROWS), rows, dtype=torch.int64, device=dev)       # see INT_ROWS
            self.floats = torch.ones(len(FLOAT_ROWS), rows, dtype=torch.float32, device=dev)  # see FLOAT_ROWS
            self.block_tables = torch.zeros(rows, max_pages_per_seq, dtype=torch.int32, device=dev)
            # cascade groups (cascade.PrefixGroups), one slot per row: rows // group_splits(rows) are read
            self.prefix_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
            self.group_rows = torch.full((rows, self.members), -1, dtype=torch.int32, device=dev)
            self.group_prefix = torch.zeros(rows, dtype=torch.int32, device=dev)
            self.no_threshold = torch.full((rows,), float("-inf"), device=dev)
            self.out_tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
            self.out_log_probs = torch.zeros(rows, dtype=torch.float32, device=dev)

    def release(self) -> None:
        """Give the KV cache's memory back. Graphs survive when the cache is a StableBuffer."""
        self.cache = None
        if self.stable:
            for buf in self.stable:
                buf.unmap()
        else:
            self.graphs.clear()
            self.pool = None
        if self.on_gpu:
            torch.cuda.empty_cache()

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: SamplingRows, truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.on_gpu:
            return sample_reference(logits, rows, truncate)
        from furlong.engine.kernels import sample_chunks, sample_tokens
        if truncate:
            thr = row_thresholds(logits.float() * rows.inv_temperature[:, None], rows.top_k, rows.top_p)
            thr = torch.where(rows.greedy, float("-inf"), thr)
        else:
            thr = self.no_threshold[:logits.shape[0]]
        return sample_tokens(logits, rows.inv_temperature, rows.greedy, thr, rows.seed32, rows.positions,
                             num_chunks=sample_chunks(logits.shape[0], logits.shape[1], self.num_sms))

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Packed forward over each item's token_ids (slots from its first sequence's block table).
        Returns the last position's logits per item, [N, V]."""
        ids, pos, pages, offs, cu = [], [], [], [], [0]
        ps = self.page_size
        for item in items:
            table = item.sequences[0].block_table
            n = len(item.token_ids)
            ids.extend(item.token_ids)
            pos.extend(range(n))
            pages.extend(table[i // ps] for i in range(n))
            offs.extend(i % ps for i in range(n))
            cu.append(cu[-1] + n)
        dev = self.device
        as_t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt).to(dev, non_blocking=True)
        ctx = PrefillContext(self.cache, as_t(pages), as_t(offs), as_t(cu, torch.int32),
                             max(b - a for a, b in zip(cu[:-1], cu[1:])))
        hidden = self.forward.hidden(as_t(ids), as_t(pos), ctx.attend)                    # [T, H]
        return self.forward.logits(hidden[as_t(cu[1:]) - 1])

    def sample_first(self, logits: torch.Tensor, items: list[PrefillItem]) -> StepOutput:
        """The first new token of every sequence of every item (an item's n samples share its logits)."""
        seqs = [s for item in items for s in item.sequences]
        reps = torch.tensor([len(item.sequences) for item in items], device=self.device)
        logits = logits.repeat_interleave(reps, dim=0, output_size=len(seqs))   # output_size: no sync
        ints, floats = sampling_rows_host(seqs, self.args.vocab_size)
        positions = [len(item.token_ids) for item in items for _ in item.sequences]
        rows = self._rows(torch.tensor(ints, device=self.device), torch.tensor(floats, device=self.device),
                          torch.tensor(positions, device=self.device))
        tok, lp = self.sample(logits, rows, truncate=any(s.params.truncates for s in seqs))
        return StepOutput([[t] for t in tok.tolist()], [[x] for x in lp.tolist()])   # one sync

    @staticmethod
    def _rows(ints: torch.Tensor, floats: torch.Tensor, positions: torch.Tensor) -> SamplingRows:
        """ints rows: seed32, top_k, greedy; floats rows: inv_temperature, top_p."""
        return SamplingRows(inv_temperature=floats[0], greedy=ints[2] != 0, top_k=ints[1], top_p=floats[1],
                            seed32=ints[0], positions=positions)

    # ---- decode --------------------------------------------------------------------------------
    def _splits(self, units: int, cap: int) -> int:
        """KV-length splits so that (unit, kv head, split) programs number ~4 per multiprocessor: a
        power of two in [1, cap] (1 on the CPU)."""
        if not self.on_gpu:
            return 1
        want = -(-4 * self.num_sms // (max(1, units) * self.args.num_kv_heads))
        return max(1, min(cap, 1 << (want - 1).bit_length()))

    def num_splits(self, rows: int) -> int:
        """KV-length splits of each row's own tokens."""
        return self._splits(rows, 16)

    def group_splits(self, rows: int) -> int:
        """KV-length splits of a cascade group's prefix, counted as if the rows formed full groups; at
        most `members`, since the grid holds rows // group_splits groups."""
        return self._splits(rows // self.members, self.members)

    def _step(self, rows: int, truncate: bool, cascade: bool) -> None:
        """One decode step over the first `rows` buffer rows, state advanced in place (graph-safe)."""
        ids, pos = self.ints[0, :rows], self.ints[1, :rows]
        tables = self.block_tables[:rows]
        page = tables.gather(1, (pos // self.page_size)[:, None]).squeeze(1).long()
        prefix = PrefixGroups(self.prefix_lens[:rows], self.group_rows[:rows], self.group_prefix[:rows]) \
            if cascade else None
        ctx = DecodeContext(self.cache, page, pos % self.page_size, tables, (pos + 1).to(torch.int32),
                            self.num_splits(rows), self.on_gpu, prefix, self.group_splits(rows))
        logits = self.forward.logits(self.forward.hidden(ids, pos, ctx.attend))
        rows_in = self._rows(self.ints[2:, :rows], self.floats[:, :rows], pos + 1)
        tok, lp = self.sample(logits, rows_in, truncate)
        self.out_tokens[:rows].copy_(tok)
        self.out_log_probs[:rows].copy_(lp)
        ids.copy_(tok)
        pos.add_(1)

    def _capture(self, rows: int, truncate: bool, cascade: bool) -> None:
        self.ints[:, :rows].zero_()            # padded-row state: position 0, scratch page 0
        self.block_tables[:rows].zero_()
        self.prefix_lens[:rows].zero_()        # no groups
        self.group_rows[:rows].fill_(-1)
        self.group_prefix[:rows].zero_()
        self._step(rows, truncate, cascade)    # warm-up: compiles the Triton kernels
        torch.cuda.synchronize(self.device)
        self.ints[:, :rows].zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(rows, truncate, cascade)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(rows, truncate, cascade)] = graph

    def _stage(self, seqs: list[Sequence], rows: int, key: tuple) -> None:
        """Write the window's inputs into the decode buffers. Host staging arrays are reused: the
        per-sequence sampling rows are rebuilt only when the running set (`key`) changed, and
        block-table rows only where a table grew; ids and positions are rewritten every window."""
        width = self.block_tables.shape[1]
        if key != self._stage_key:
            self._stage_key = key
            self._host_ints = np.zeros((len(INT_ROWS), rows), dtype=np.int64)
            self._host_floats = np.ones((len(FLOAT_ROWS), rows), dtype=np.float32)
            self._host_tables = np.zeros((rows, width), dtype=np.int32)
            self._table_lens = [0] * len(seqs)
            ints, floats = sampling_rows_host(seqs, self.args.vocab_size)
            self._host_ints[2:, :len(seqs)] = ints
            self._host_floats[:, :len(seqs)] = floats
            self.floats[:, :rows].copy_(torch.from_numpy(self._host_floats))
            for buf, host in zip((self.prefix_lens, self.group_rows, self.group_prefix),
                                 group_arrays(self._groups(seqs, rows, key), rows, self.members)):
                buf[:rows].copy_(torch.from_numpy(host))
        for i, s in enumerate(seqs):
            n = len(s.block_table)
            if n != self._table_lens[i]:
                self._host_tables[i, self._table_lens[i]:n] = s.block_table[self._table_lens[i]:]
                self._table_lens[i] = n
        self._host_ints[0, :len(seqs)] = [s.token_ids[-1] for s in seqs]
        self._host_ints[1, :len(seqs)] = [s.num_tokens - 1 for s in seqs]
        self.ints[:, :rows].copy_(torch.from_numpy(self._host_ints))
        self.block_tables[:rows].copy_(torch.from_numpy(self._host_tables))

    def _groups(self, seqs: list[Sequence], rows: int, key: tuple) -> tuple[list[int], list[list[int]], list[int]]:
        """plan_groups of this running set (`key`), computed once per running set; none with cascade off."""
        if self._plan[0] != key:
            capacity = rows // self.group_splits(rows)
            plan = plan_groups(seqs, self.members, self.cascade_min_prefix, capacity) if self.cascade \
                else ([0] * len(seqs), [], [])
            self._plan = (key, *plan)
        return self._plan[1:]

    def decode(self, seqs: list[Sequence], window: int) -> StepOutput:
        num = len(seqs)
        rows = self.buckets[bisect.bisect_left(self.buckets, num)] if self.use_cuda_graphs else num
        truncate = any(s.params.truncates for s in seqs)
        # the running set: serials, not object ids (a new sequence may get a freed one's address)
        key = (rows, tuple(s.serial for s in seqs), self.cascade)
        prefix_lens, groups, _ = self._groups(seqs, rows, key)
        cascade = bool(groups)
        if self.use_cuda_graphs and (rows, truncate, cascade) not in self.graphs:
            self._capture(rows, truncate, cascade)
            self._stage_key = None       # capture overwrote the buffers
        self._stage(seqs, rows, key)
        toks = torch.empty(window, rows, dtype=torch.int64, device=self.device)
        lps = torch.empty(window, rows, dtype=torch.float32, device=self.device)
        for i in range(window):
            if self.use_cuda_graphs:
                self.graphs[(rows, truncate, cascade)].replay()
            else:
                self._step(rows, truncate, cascade)
            toks[i].copy_(self.out_tokens[:rows])
            lps[i].copy_(self.out_log_probs[:rows])
        # The window's one host sync: the scheduler needs the tokens to find finished rows.
        return StepOutput(toks[:, :num].T.tolist(), lps[:, :num].T.tolist(),
                          sum(1 for p in prefix_lens if p > 0))
