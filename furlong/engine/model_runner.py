"""The model runner: owns the engine's tensors and graphs; runs prefills and decode windows.

It owns the KV cache, the decode buffers and the CUDA graphs, and runs the two
kinds of forward the scheduler plans:

  prefill  one packed varlen forward over the new tokens of several sequences
           (eager: its token count changes every time), writing their K/V into
           the cache; logits only at each sequence's last position (prefill.py).
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
           The buffers and their staging: decode_inputs.py.
On CPU the same step function runs eagerly with the reference attention and
sampler, so CPU tests exercise the scheduling, paging and on-device state
updates that the GPU runs.

The model's weights are used in place: weight sync copies into the same
parameter storage, so captured graphs stay valid. The KV cache is allocated
per generation session and freed after it (the colocated trainer needs the
memory; cache_memory.py): on CUDA its address stays across sessions, so the
graphs, the small decode buffers and the graph pool are kept for the next
session; without the driver API the graphs are dropped with it.
"""
from __future__ import annotations

import bisect

import torch

from furlong.engine.cache_memory import CacheMemory
from furlong.engine.cascade import GroupPlan, cascade_members, no_groups, plan_groups
from furlong.engine.decode_inputs import DecodeInputs, StepInputs
from furlong.engine.forward import EngineForward
from furlong.engine.kv_cache import DecodeContext, KVLayout, PagedKVCache, rows_transposed
from furlong.engine.kv_fp8 import FP8, kv_storage_dtype
from furlong.engine.overlap import run_halves
from furlong.engine.plan import Plan, PrefillItem
from furlong.engine.prefill import launch_prefill
from furlong.engine.sampling import SamplingRows, row_thresholds, sample_reference
from furlong.engine.sequence import Sequence, StepOutput
from furlong.engine.splits import program_splits, resident_programs, wave_splits
from furlong.engine.weight_arena import WeightArena

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                 640, 768, 896, 1024)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, page_size: int, max_num_seqs: int, use_cuda_graphs: bool,
                 compile: bool, cascade: bool = True, cascade_min_prefix: int = 1, kv_dtype: str = "auto",
                 offload_weights: bool = False):
        self.model = model
        # offload_weights: the weights in one arena whose memory release_weights gives back (weight_arena.py)
        self.weights = (WeightArena.for_tensors(list(model.parameters()), next(model.parameters()).device)
                        if offload_weights else None)
        self.forward = EngineForward(model, compile=compile, arena=self.weights)
        self.args = model.args
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.page_size = page_size
        store = kv_storage_dtype(kv_dtype, self.dtype)
        self.layout = KVLayout(self.args.num_layers, self.args.num_kv_heads, page_size, self.args.head_dim, store,
                               scaled=store == FP8)
        self.on_gpu = self.device.type == "cuda"
        self.use_cuda_graphs = use_cuda_graphs and self.on_gpu
        self.buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.cache: PagedKVCache | None = None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}   # by (rows, truncate, cascade, splits, halves,
        #                                                         fuse_prologue, fp8_kernel)
        self.cascade = cascade                # may be switched between decode windows (graphs exist for both)
        self.members = cascade_members(self.args.num_heads, self.args.num_kv_heads)   # rows per cascade group
        self.cascade_min_prefix = cascade_min_prefix   # shortest shared prompt worth a group (tokens)
        # the decode kernel's split count: "programs" (splits.program_splits) or "waves" (splits.wave_splits,
        # a tie over the long rollout: splits.py); may be switched between decode windows (graphs are per count)
        self.split_rule = "programs"
        # switchable between windows (graph key): decode steps norm and rope q, k and store the KV in one kernel
        # a layer (store_kernels.decode_prologue; off: for benches); fp8 attention's kernel (kv_cache.FP8_KERNELS)
        self.fuse_prologue = True
        self.fp8_kernel = "transposed-all"
        # windows with at least this many running rows run each step as two halves on two streams
        # (overlap.py; in the graph key); 0: never, the default until measured on a GPU
        self.overlap_min_rows = 0
        self.side_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self.pool = None
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.on_gpu else 1
        self.cache_memory = CacheMemory(self.layout, self.device)   # the KV cache's bytes per session
        self.inputs: DecodeInputs | None = None   # decode buffers, made on first use (see allocate)
        self.no_threshold: torch.Tensor | None = None   # [R] -inf: the sampler's threshold when nothing is cut
        self.kv_bytes = 0                     # KV cache of the current session
        self._group_key: tuple | None = None  # running set (and split) whose cascade plan _group_plan is
        self._group_plan: list[tuple[int, GroupPlan]] = []

    # ---- session -------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one page, keys and values (fp8: with their scales, about half of bf16's)."""
        return 2 * self.layout.page_bytes

    def allocate(self, num_pages: int, max_pages_per_seq: int) -> None:
        dev, rows = self.device, self.buckets[-1]
        self.cache, kept = self.cache_memory.map(num_pages)
        if not kept:
            self._drop_graphs()
        self.kv_bytes = num_pages * self.page_bytes()
        self.cache.zero_page(0)        # the scratch page: padded rows read it, keep it finite
        self._group_key = None                # serials restart with the session's scheduler
        if self.inputs is None or self.inputs.max_pages != max_pages_per_seq:
            self._drop_graphs()
            self.inputs = DecodeInputs(rows, max_pages_per_seq, self.members, dev)
            self.no_threshold = torch.full((rows,), float("-inf"), device=dev)
        self.inputs.forget()

    def release(self) -> None:
        """Give the KV cache's memory back. Graphs survive when the cache is a StableBuffer."""
        self.cache = None
        if not self.cache_memory.unmap():
            self._drop_graphs()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        # with the pool: capturing into a pool whose graphs are all gone trips the caching allocator's assert
        self.graphs.clear()
        self.pool = None

    def release_weights(self) -> None:
        """Give the weights' memory back for training (offload_weights; nothing may be running); the
        values are lost: restore_weights, then the weight sync writes every weight."""
        if self.weights is None:
            raise RuntimeError("ModelRunner.release_weights: the runner was made without offload_weights")
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self.weights.release()
        if not self.weights.stable:     # the weights' address may move: graphs captured over them go
            self._drop_graphs()

    def restore_weights(self) -> None:
        """Take the weights' memory again, contents undefined until the weight sync writes them."""
        if self.weights is not None and self.weights.released:
            if self.on_gpu:   # the trainer's cached blocks: the driver must have the memory to map
                torch.cuda.empty_cache()
            self.weights.restore()

    @property
    def weights_released(self) -> bool:
        return self.weights is not None and self.weights.released

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: SamplingRows, truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.on_gpu:
            return sample_reference(logits, rows, truncate)
        from furlong.engine.sample_kernels import sample_chunks, sample_tokens
        if truncate:
            thr = row_thresholds(logits.float() * rows.inv_temperature[:, None], rows.top_k, rows.top_p)
            thr = torch.where(rows.greedy, float("-inf"), thr)
        else:
            thr = self.no_threshold[:logits.shape[0]]
        return sample_tokens(logits, rows.inv_temperature, rows.greedy, thr, rows.seed32, rows.positions,
                             num_chunks=sample_chunks(logits.shape[0], logits.shape[1], self.num_sms))

    # ---- a step -------------------------------------------------------------------------------
    def run(self, plan: Plan) -> StepOutput:
        """The plan's decode window, then its prefill queued behind it on the device (launched without a
        host sync, host_copy.py, so the host builds the prefill while the window runs), then ONE sync for
        both: rows in the scheduler's order, decode rows first."""
        toks, lps, grouped = self._launch_decode(plan.decode, plan.window) if plan.decode else (None, None, 0)
        first = self._launch_prefill(plan.prefill) if plan.prefill else None
        # the step's one host sync: the scheduler needs the tokens to find finished rows
        out = StepOutput(toks[:, :len(plan.decode)].T.tolist(), lps[:, :len(plan.decode)].T.tolist(),
                         grouped) if plan.decode else StepOutput([], [])
        if first is not None:
            out.tokens += [[t] for t in first[0].tolist()]
            out.log_probs += [[x] for x in first[1].tolist()]
        return out

    def prefill(self, items: list[PrefillItem]) -> StepOutput:
        return self.run(Plan(prefill=items, decode=[], window=0))

    def decode(self, seqs: list[Sequence], window: int) -> StepOutput:
        return self.run(Plan(prefill=[], decode=seqs, window=window))

    def _launch_prefill(self, items: list[PrefillItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """prefill.launch_prefill over this runner's cache, forward and sampler: (tokens, log_probs) [N]."""
        return launch_prefill(items, self.cache, self.forward, self.sample, self.page_size, self.args.vocab_size,
                              self.device)

    # ---- decode --------------------------------------------------------------------------------
    def num_splits(self, num_rows: int, padded_rows: int, longest: int, cascade: bool) -> int:
        """KV-length splits of each row's own tokens, for `num_rows` running rows (padded to a bucket of
        `padded_rows`) whose longest context is `longest` tokens (splits.py; 1 on the CPU). Padded rows
        attend to one token: the wave rule counts only the real ones."""
        if not self.on_gpu:
            return 1
        if self.split_rule == "programs":
            return program_splits(padded_rows, self.args.num_kv_heads, self.num_sms)
        slots = self.num_sms * resident_programs(self.layout.scaled, cascade, rows_transposed(self.fp8_kernel, cascade))
        # 64: the kernel's default tile (kernels.paged_decode_attention's block_n, at most a page)
        return wave_splits(num_rows, longest, min(64, self.page_size), self.args.num_kv_heads, slots)

    def group_splits(self, rows: int) -> int:
        """KV-length splits of a cascade group's prefix, counted as if the rows formed full groups; at
        most `members`, since the grid holds rows // group_splits groups (1 on the CPU)."""
        if not self.on_gpu:
            return 1
        return program_splits(rows // self.members, self.args.num_kv_heads, self.num_sms, cap=self.members)

    def _hidden(self, x: StepInputs, lo: int, hi: int, cascade: bool, splits: int) -> torch.Tensor:
        """Final-normed hidden states [hi - lo, H] of step rows [lo, hi)."""
        ids, pos, tables = x.input_ids[lo:hi], x.positions[lo:hi], x.block_tables[lo:hi]
        page = tables.gather(1, (pos // self.page_size)[:, None]).squeeze(1).long()
        groups = x.groups.rows(lo, hi) if cascade else None     # staged per half with halves: local indices
        ctx = DecodeContext(self.cache, page, pos % self.page_size, tables, (pos + 1).to(torch.int32), splits,
                            self.on_gpu, groups, self.group_splits(hi - lo), self.fp8_kernel)
        fused = ctx.attend_qkv if self.on_gpu and self.fuse_prologue else None
        return self.forward.hidden(ids, pos, ctx.attend, fused)

    def _step(self, rows: int, truncate: bool, cascade: bool, splits: int, halves: bool = False) -> None:
        """One decode step over the first `rows` buffer rows, state advanced in place (graph-safe);
        `halves`: the rows' two halves each run their forward, the second on the side stream (overlap.py)."""
        x = self.inputs.step_inputs(rows)
        if halves:
            h = rows // 2
            hidden = run_halves(lambda: self._hidden(x, 0, h, cascade, splits),
                                lambda: self._hidden(x, h, rows, cascade, splits), self.side_stream)
        else:
            hidden = self._hidden(x, 0, rows, cascade, splits)
        logits = self.forward.logits(hidden)
        tok, lp = self.sample(logits, x.sampling(x.positions + 1), truncate)
        x.out_tokens.copy_(tok)
        x.out_log_probs.copy_(lp)
        x.input_ids.copy_(tok)
        x.positions.add_(1)

    def _capture(self, key: tuple[int, bool, bool, int, bool, bool, str]) -> None:
        step = key[:5]                         # rows, truncate, cascade, splits, halves
        self.inputs.clear(step[0])             # padded-row state: position 0, scratch page 0, no groups
        self._step(*step)                      # warm-up: compiles the Triton kernels
        torch.cuda.synchronize(self.device)
        self.inputs.clear(step[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(*step)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph

    def _groups(self, seqs: list[Sequence], rows: int, key: tuple, split: int) -> list[tuple[int, GroupPlan]]:
        """The cascade plan of this running set (`key`) as (first row, plan) parts: one for the whole batch,
        or (split > 0, halves) one per half, rows indexed within it (a fork group across the split makes
        a group on each side); computed once per running set; no groups with cascade off."""
        if self._group_key != key:
            bounds = [(0, rows)] if not split else [(0, split), (split, rows)]
            self._group_plan = [(lo, plan_groups(seqs[lo:hi], self.members, self.cascade_min_prefix,
                                                 (hi - lo) // self.group_splits(hi - lo))
                                 if self.cascade else no_groups(len(seqs[lo:hi]))) for lo, hi in bounds]
            self._group_key = key
        return self._group_plan

    def _launch_decode(self, seqs: list[Sequence], window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The window's steps over `seqs`: (tokens, log_probs) [window, rows] on the device (rows: the
        padded batch), and the rows read through cascade groups."""
        num = len(seqs)
        rows = self.buckets[bisect.bisect_left(self.buckets, num)] if self.use_cuda_graphs else num
        truncate = any(s.params.truncates for s in seqs)
        halves = rows >= 2 and 0 < self.overlap_min_rows <= num
        # the running set: serials, not object ids (a new sequence may get a freed one's address)
        key = (rows, tuple(s.serial for s in seqs), self.cascade, halves)
        parts = self._groups(seqs, rows, key, rows // 2 if halves else 0)
        cascade = any(plan.groups for _, plan in parts)
        # the longest context the window reaches (the rows grow by one token a step); with halves, each
        # half's attention gets the split count of a batch its size, so that alone it fills the GPU
        longest = max(s.num_tokens for s in seqs) + window
        splits = (self.num_splits(num // 2, rows // 2, longest, cascade) if halves
                  else self.num_splits(num, rows, longest, cascade))
        graph_key = (rows, truncate, cascade, splits, halves, self.fuse_prologue, self.fp8_kernel)
        if self.use_cuda_graphs and graph_key not in self.graphs:
            self._capture(graph_key)     # overwrote the buffers: clear() restages them all
        self.inputs.stage(seqs, rows, key, parts, self.args.vocab_size)
        toks = torch.empty(window, rows, dtype=torch.int64, device=self.device)
        lps = torch.empty(window, rows, dtype=torch.float32, device=self.device)
        x = self.inputs.step_inputs(rows)
        for i in range(window):
            if self.use_cuda_graphs:
                self.graphs[graph_key].replay()
            else:
                self._step(rows, truncate, cascade, splits, halves)
            toks[i].copy_(x.out_tokens)
            lps[i].copy_(x.out_log_probs)
        return toks, lps, sum(1 for _, plan in parts for p in plan.prefix_lens if p > 0)
