"""Continuous batching: which sequences run the next engine step.

Plain Python over the BlockManager; no tensors. Each `schedule()` returns a
plan, and `postprocess` takes what the model runner sampled for it:

  Prefill  waiting work admitted in FIFO order while it fits: a new request
           (its prompt prefilled once, then forked into n samples: tables made
           at admission, the runner copies the last partial page after the
           prefill) or a preempted sequence (its tokens re-prefilled). Admission
           needs pages for the prompt, the copied last pages of the fork, and
           one decode window of head-room per sample, plus a free running slot
           per sample (`max_num_seqs`, the largest decode batch) and room in
           the prefill token budget. To keep prefills from stalling decode for
           a few rows at a time, work is admitted while others run only once at
           least `min_admit` samples fit (or all that wait do).
  Decode   every running sequence advances one window of `window` tokens. Pages
           for the window are taken up front (the GPU writes them without asking
           the host); when pages run out, the most recently admitted sequence
           is preempted: its pages are freed and it waits at the head of the
           queue to be re-prefilled (recompute, as vLLM's default).
  Mixed    (`mix_prefill`, the default) while rows run, waiting work is admitted
           after they took their window's pages and prefilled in the same step,
           behind the window on the device: the host builds and launches the
           eager prefill while the GPU runs the window's graphs, and one sync
           reads both (a conversation's next turn no longer stops decode for
           a step of its own). Admission as for Prefill, in steps that preempt
           nothing. With nothing running: a Prefill plan.
  postprocess  prefilled sequences join the running set; each row keeps its
           new tokens up to its first stop (stop.py); finished rows leave and
           free their pages (a `retain_kv` request's are parked for its next
           turn instead, retained.py); the step is counted in the engine's stats.
A `continues` request waits as a sequence that holds its cached prefix's pages
and prefills the rest. Pages run short: parked pages are freed first, then
waiting continuations' prefixes (recomputed when admitted), then rows preempted.
Shared prompts (`share_prompts`): new requests with the same prompt admitted in one step (the n
conversations of a custom-generate group each submit the group's prompt as their first turn) are
prefilled as ONE item whose sequences fork its pages, as a request's n samples do; the joiners cost
no prefill budget, and decode reads their prompt as one cascade group (Sequence.fork_group). Each
keeps its own request (id, sampling, seed, retain_kv): its tokens are a separate prefill's.
"""
from __future__ import annotations

import itertools
from collections import deque

from furlong.engine.admission import prefill_items
from furlong.engine.block_manager import BlockManager, pages_for
from furlong.engine.plan import Plan, PrefillItem
from furlong.engine.retained import RetainedKV
from furlong.engine.sequence import Request, Sequence, Status, StepOutput
from furlong.engine.stats import EngineStats
from furlong.engine.stop import StopRules


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_prefill_tokens: int, window: int,
                 max_model_len: int, stop_rules: StopRules, stats: EngineStats, min_admit: int = 1,
                 share_prompts: bool = True, mix_prefill: bool = True):
        self.blocks = blocks
        self.stop_rules = stop_rules
        self.stats = stats                        # counted into; the engine owns and resets it
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.window = window
        self.max_model_len = max_model_len
        self.min_admit = min_admit
        self.share_prompts = share_prompts
        self.mix_prefill = mix_prefill
        self.waiting: deque[Request | Sequence] = deque()
        self.running: list[Sequence] = []
        self.active_ids: dict[int, int] = {}      # request id -> samples not yet finished
        self._serials = itertools.count()         # Sequence.serial of each admission
        self.retained = RetainedKV(blocks)        # finished `retain_kv` sequences, pages kept for the next turn

    def add(self, request: Request) -> None:
        if request.request_id in self.active_ids:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        request.check()
        if request.n > self.max_num_seqs:
            raise ValueError(f"request {request.request_id}: n={request.n} samples exceed --rollout-max-num-seqs "
                             f"{self.max_num_seqs}")
        need = len(request.prompt_ids) + max(request.sample_max_new_tokens or [request.params.max_new_tokens])
        if need > self.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt {len(request.prompt_ids)} + max_new_tokens "
                             f"{request.params.max_new_tokens} exceeds the engine's max length {self.max_model_len}")
        if self._pages_needed(request) > self.blocks.num_blocks - 1:
            raise ValueError(f"request {request.request_id}: needs {self._pages_needed(request)} KV pages, the cache "
                             f"has {self.blocks.num_blocks - 1} (raise --rollout-kv-fraction)")
        self.waiting.append(request if request.continues is None else self.retained.continuation(request))
        self.active_ids[request.request_id] = request.n

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _unit(self, item: Request | Sequence) -> tuple[int, int]:
        """(samples, prefill tokens) of a waiting item."""
        if isinstance(item, Request):
            return item.n, item.num_tokens
        return 1, item.num_tokens - item.num_cached

    def _pages_needed(self, item: Request | Sequence) -> int:
        num, tokens = self._unit(item)
        size = self.blocks.block_size
        if isinstance(item, Request):
            own = pages_for(tokens, size) + self.blocks.fork_cost(tokens, num)
        else:       # preempted (no pages) or a continuation (its cached prefix's pages held)
            own = pages_for(item.num_tokens, size) - len(item.block_table)
        return own + num * pages_for(self.window + 1, size)    # head-room: one decode window per sample

    def _shared_key(self, item: Request | Sequence) -> tuple[int, ...] | None:
        """The prompt a new request may share with another admitted in the same step (None: never; a
        resumed partial sample carries its own earlier tokens, so it prefills alone)."""
        if not self.share_prompts or not isinstance(item, Request) or item.resume_ids:
            return None
        return tuple(item.prompt_ids)

    def _admit(self) -> list[PrefillItem]:
        free_pages, free_rows = self.blocks.num_free, self.max_num_seqs - len(self.running)
        budget = self.max_prefill_tokens
        picked: list[Request | Sequence] = []
        prompts: set[tuple[int, ...]] = set()     # prompts prefilled by this step's picks so far
        rows = 0
        for item in self.waiting:
            num, tokens = self._unit(item)
            key = self._shared_key(item)
            if key is not None and key in prompts:   # joins that prefill: its fork pages and head-room only
                tokens, head_room = 0, num * pages_for(self.window + 1, self.blocks.block_size)
                pages = self.blocks.fork_cost(len(key), num + 1) + head_room
            else:
                pages = self._pages_needed(item)
            if num > free_rows or pages > free_pages or (picked and tokens > budget):
                break
            picked.append(item)
            if key is not None:
                prompts.add(key)
            free_rows, free_pages, budget, rows = free_rows - num, free_pages - pages, budget - tokens, rows + num
        if self.running and rows < min(self.min_admit, sum(self._unit(i)[0] for i in self.waiting)):
            return []
        for _ in picked:
            self.waiting.popleft()
        return prefill_items(picked, self.blocks, self._shared_key, self._serials)

    def schedule(self) -> Plan | None:
        if self.waiting and not (self.mix_prefill and self.running):
            items = self._admit_waiting()
            if items:
                return Plan(prefill=items, decode=[], window=0)
            if not self.running:
                raise RuntimeError("scheduler: nothing runs and the first waiting request does not fit")
        if not self.running:
            return None
        remaining = max(s.max_new_tokens - s.num_generated for s in self.running)
        window = max(1, min(self.window, remaining))
        # Pages for the window: writes land at positions num_tokens-1 .. num_tokens-2+window.
        i, preempted = 0, self.stats.num_preemptions
        while i < len(self.running):
            seq = self.running[i]
            if self.blocks.can_grow(seq.block_table, seq.num_tokens - 1 + window):
                self.blocks.grow(seq.block_table, seq.num_tokens - 1 + window)
                i += 1
                continue
            # parked pages first, then waiting continuations' cached prefixes, then the newest running row
            if self.retained.evict_oldest() or self._drop_waiting_prefix(keep_first=False):
                continue
            victim = self.running[-1]
            if victim is seq and i == 0:
                raise RuntimeError(f"scheduler: one sequence ({seq.num_tokens} tokens) does not fit the KV cache")
            self.preempt(victim)
        # admitted after the running rows took their window's pages: new work never preempts older
        mix = self.mix_prefill and self.waiting and self.stats.num_preemptions == preempted
        prefill = self._admit_waiting() if mix else []
        used = self.blocks.num_used / max(self.blocks.num_blocks - 1, 1)
        # A prompt group's rows side by side (stable: admission order within it): the decode kernel runs rows
        # in order, so the group's prompt pages stay in L2 (continuations rejoin scattered; cascade.py).
        rows = sorted(self.running, key=lambda s: s.fork_group)
        return Plan(prefill=prefill, decode=rows, window=window, kv_used=used)

    def _admit_waiting(self) -> list[PrefillItem]:
        """Room for the head of the queue, then admission (the prefill-only and the mixed step alike)."""
        self._make_room(self._pages_needed(self.waiting[0]))
        return self._admit()

    def _make_room(self, need: int) -> None:
        """Free pages for the first waiting item: parked pages; with nothing running (no page will come back
        otherwise), the cached prefixes of later waiting continuations."""
        while self.blocks.num_free < need and self.retained.evict_oldest():
            pass
        while self.blocks.num_free < need and not self.running and self._drop_waiting_prefix(keep_first=True):
            pass

    def _drop_waiting_prefix(self, keep_first: bool) -> bool:
        """Free the cached prefix of the latest waiting continuation holding one (it is recomputed when
        admitted); False if none (`keep_first`: the head of the queue keeps its own)."""
        for item in reversed(self.waiting):
            if keep_first and item is self.waiting[0]:
                return False
            if isinstance(item, Sequence) and item.block_table:
                self.blocks.release(item.block_table)
                item.num_cached, item.shared_prefix = 0, 0
                return True
        return False

    def start(self, seqs: list[Sequence]) -> None:
        """Prefilled sequences join the running set."""
        for s in seqs:
            s.status = Status.RUNNING
            self.running.append(s)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.num_cached, seq.shared_prefix = 0, 0   # re-prefilled into its own pages: no longer its group's KV
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, plan: Plan, out: StepOutput) -> list[Sequence]:
        """Take the plan's sampled tokens (a row per sequence: the decode rows, then the prefilled
        sequences); returns the sequences that finished in this step."""
        self.stats.count_step(plan, out.num_grouped_rows)   # before the rows grow: their context as attended
        prefilled = [s for item in plan.prefill for s in item.sequences]
        self.start(prefilled)
        seqs = plan.decode + prefilled
        done, kept = [], 0
        for seq, toks, lps in zip(seqs, out.tokens, out.log_probs):
            before = seq.num_generated
            reason = self.stop_rules.append(seq, toks, lps)
            kept += seq.num_generated - before
            if reason is not None:
                self.finish(seq, reason)
                done.append(seq)
        self.stats.num_generated_tokens += kept
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.request.retain_kv and reason != "abort":
            self.retained.park(seq)
        else:
            self.blocks.release(seq.block_table)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._retire(seq.request.request_id)

    def _retire(self, request_id: int, num: int = 1) -> None:
        left = self.active_ids.pop(request_id, 0) - num
        if left > 0:
            self.active_ids[request_id] = left

    def abort(self, request_ids: set[int]) -> list[Sequence]:
        """Drop every waiting or running sequence of these requests (and their parked pages); returns the
        sequences aborted."""
        self.retained.drop(request_ids)
        aborted = [s for s in self.running if s.request.request_id in request_ids]
        for s in aborted:
            self.finish(s, "abort")
        kept: deque[Request | Sequence] = deque()
        for item in self.waiting:
            rid = item.request_id if isinstance(item, Request) else item.request.request_id
            if rid in request_ids:
                if isinstance(item, Sequence):
                    self.blocks.release(item.block_table)      # a continuation's cached prefix
                    item.status, item.finish_reason = Status.FINISHED, "abort"
                    aborted.append(item)
                    self._retire(rid)
                else:
                    self._retire(rid, item.n)
            else:
                kept.append(item)
        self.waiting = kept
        return aborted
