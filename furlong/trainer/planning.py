"""Micro-batch planning: splitting a step's samples over ranks and micro-batches.

Planning (docs/design.md §5, dynamic batching). `plan_micro_batches` puts samples
(by token count) into the fewest micro-batches whose packed token sum stays
<= max_tokens; a sample longer than the budget sits alone. It
  1. counts bins with first-fit-decreasing (FFD): k bins;
  2. partitions the samples into k bins with Karmarkar-Karp largest
     differencing (KK), which balances the sums;
  3. repairs the cap: moves (or swaps) items out of over-full bins into bins
     with room, each move strictly lowering the total overflow;
  4. keeps whichever of {KK+repair, FFD} has the smaller largest bin, then
     lowers the heaviest bin by single moves/swaps into lighter ones (KK
     alone splits [3,3,2,2,2] as 7/5; one swap makes it 6/6).
When repair fails we fall back to FFD (which fits in k bins) rather than
trying k+1 bins: the design (docs/design.md §5) asks for the fewest micro-batches first, balance second. miles counts bins with
first-fit and balances without re-checking the cap; furlong enforces it.
`split_across_ranks` balances all samples over ranks with KK + the same
refinement (no cap). Everything is deterministic (ties break on sample index).
These names are also re-exported by furlong.trainer.batching (the stable import path).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


def _ffd(lengths: list[int], items: list[int], cap: int) -> list[list[int]]:
    """First-fit decreasing bins of `items` under `cap` (every item must fit alone)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= cap:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _karmarkar_karp(lengths: list[int], items: list[int], k: int) -> list[list[int]]:
    """k-way largest differencing: repeatedly merge the two partial partitions with
    the largest spread, pairing the heaviest subset of one with the lightest of the other.

    A partial partition lists only its non-empty subsets, heaviest first; the
    missing ones are empty (so a single item costs O(1), not O(k))."""
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for seq, i in enumerate(sorted(items, key=lambda i: (-lengths[i], i))):
        heap.append((-lengths[i] if k > 1 else 0, seq, [(lengths[i], [i])]))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        na, nb = len(a), len(b)
        # Slot j pairs a[j] with b[k-1-j]; only slots touching a non-empty subset matter.
        slots = range(k) if na + nb >= k else [*range(na), *range(k - nb, k)]
        merged = []
        for j in slots:
            x = a[j] if j < na else (0, [])
            y = b[k - 1 - j] if k - 1 - j < nb else (0, [])
            merged.append((x[0] + y[0], x[1] + y[1]))
        merged.sort(key=lambda s: -s[0])  # stable: deterministic
        lightest = merged[-1][0] if len(merged) == k else 0
        heapq.heappush(heap, (lightest - merged[0][0], seq, merged))
        seq += 1
    parts = [sorted(items_) for _, items_ in heap[0][2]] if heap else []
    return parts + [[] for _ in range(k - len(parts))]


def _repair(lengths: list[int], bins: list[list[int]], cap: int) -> bool:
    """Move or swap items until no bin exceeds cap (in place). False if stuck.

    Each step keeps the receiving bin within cap and shrinks an over-full one,
    so the total overflow strictly drops and the loop ends.
    """
    loads = [sum(lengths[i] for i in b) for b in bins]
    while True:
        over = [b for b in range(len(bins)) if loads[b] > cap]
        if not over:
            return True
        src = max(over, key=lambda b: (loads[b], -b))
        excess = loads[src] - cap
        best = None  # (key, kind, item, dst, other)
        for i in bins[src]:
            for dst in range(len(bins)):
                if dst == src:
                    continue
                room = cap - loads[dst]
                if lengths[i] <= room:
                    # Prefer a move that clears the overflow, then the smallest such item,
                    # then the emptiest destination (keeps sums balanced).
                    key = (lengths[i] < excess, abs(lengths[i] - excess), -room, i, dst)
                    if best is None or key < best[0]:
                        best = (key, "move", i, dst, None)
                for j in bins[dst]:
                    gain = lengths[i] - lengths[j]
                    if gain > 0 and gain <= room:
                        key = (gain < excess, abs(gain - excess), -room, i, dst)
                        if best is None or key < best[0]:
                            best = (key, "swap", i, dst, j)
        if best is None:
            return False
        _, kind, i, dst, j = best
        bins[src].remove(i)
        bins[dst].append(i)
        loads[src] -= lengths[i]
        loads[dst] += lengths[i]
        if kind == "swap":
            bins[dst].remove(j)
            bins[src].append(j)
            loads[dst] -= lengths[j]
            loads[src] += lengths[j]


def _refine(lengths: list[int], bins: list[list[int]], cap: float) -> None:
    """Lower the heaviest bin by one move or swap at a time into a lighter bin (in place).

    For the heaviest bin h (lowest index on ties) and every lighter bin l, pick
    the shift d (0 < d < gap, l stays <= cap) giving the smallest new
    max(h - d, l + d). Stop once h admits none: the largest load can then not
    drop by single moves (a tie at the top only drops if every tied bin does).
    Each step strictly lowers the sum of squared loads, so it ends.
    """
    loads = [sum(lengths[i] for i in b) for b in bins]
    while bins:
        hi = max(range(len(bins)), key=lambda b: (loads[b], -b))
        top = loads[hi]
        best = None  # (key, lo, i, j or None)
        for lo in range(len(bins)):
            gap, room = top - loads[lo], cap - loads[lo]
            if gap < 2:
                continue
            for i in bins[hi]:
                for j in [None] + bins[lo]:
                    d = lengths[i] - (0 if j is None else lengths[j])
                    if 0 < d < gap and d <= room:
                        key = (max(top - d, loads[lo] + d), lo, i, -1 if j is None else j)
                        if best is None or key < best[0]:
                            best = (key, lo, i, j)
        if best is None:
            return
        _, lo, i, j = best
        bins[hi].remove(i)
        bins[lo].append(i)
        if j is not None:
            bins[lo].remove(j)
            bins[hi].append(j)
        d = lengths[i] - (0 if j is None else lengths[j])
        loads[hi] -= d
        loads[lo] += d


def _max_load(lengths: list[int], bins: list[list[int]]) -> int:
    return max((sum(lengths[i] for i in b) for b in bins), default=0)


def _ordered(lengths: list[int], bins: list[list[int]]) -> list[list[int]]:
    """Drop empty bins; indices ascending; heaviest micro-batch first (an OOM shows up at once)."""
    out = [sorted(b) for b in bins if b]
    return sorted(out, key=lambda b: (-sum(lengths[i] for i in b), b[0]))


def _check_lengths(lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sample {i}: negative token count {n}")


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices per micro-batch: fewest bins with token sum <= max_tokens, balanced."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu: must be >= 1, got {max_tokens}")
    _check_lengths(lengths)
    alone = [[i] for i, n in enumerate(lengths) if n > max_tokens]
    rest = [i for i, n in enumerate(lengths) if n <= max_tokens]
    if not rest:
        return _ordered(lengths, alone)
    ffd = _ffd(lengths, rest, max_tokens)
    kk = _karmarkar_karp(lengths, rest, len(ffd))
    best = ffd
    if _repair(lengths, kk, max_tokens) and _max_load(lengths, kk) <= _max_load(lengths, ffd):
        best = kk
    _refine(lengths, best, max_tokens)
    return _ordered(lengths, best + alone)


def split_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Token-balanced split (KK + refinement) of all samples over `world_size` ranks; a rank may get none."""
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    _check_lengths(lengths)
    if not lengths:
        return [[] for _ in range(world_size)]
    ranks = _karmarkar_karp(lengths, list(range(len(lengths))), world_size)
    _refine(lengths, ranks, float("inf"))
    return [sorted(r) for r in ranks]


def fixed_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of `micro_batch_size` indices (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size: must be >= 1, got {micro_batch_size}")
    return [list(indices[s:s + micro_batch_size]) for s in range(0, len(indices), micro_batch_size)]


def rank_micro_batches(lengths: list[int], world_size: int, max_tokens: int | None,
                       micro_batch_size: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The rank split and, per rank, its micro-batches as indices into `lengths` (identical on
    every rank): dynamic batching under `max_tokens`, or `micro_batch_size` samples when it is None."""
    split = split_across_ranks(lengths, world_size)
    plans = []
    for idx in split:
        if max_tokens is not None:
            local = plan_micro_batches([lengths[i] for i in idx], max_tokens)
        else:
            local = fixed_micro_batches(list(range(len(idx))), micro_batch_size)
        plans.append([[idx[j] for j in mb] for mb in local])
    return split, plans


def optimizer_step_chunks(num_samples: int, global_batch_size: int | None,
                          num_steps_per_rollout: int | None) -> list[list[int]]:
    """Sample indices of each optimizer step of a rollout: --num-steps-per-rollout equal steps,
    else one step per --global-batch-size samples, else one step (ValueError when uneven)."""
    if num_steps_per_rollout is not None:
        n = num_steps_per_rollout
        if num_samples % n:
            raise ValueError(f"--num-steps-per-rollout: {num_samples} samples do not split into {n} equal steps")
    elif global_batch_size is not None:
        if num_samples % global_batch_size:
            raise ValueError(f"--global-batch-size: {num_samples} samples are not a multiple of {global_batch_size}")
        n = max(num_samples // global_batch_size, 1)
    else:
        n = 1
    size = num_samples // n
    return [list(range(k * size, (k + 1) * size)) for k in range(n)]


@dataclass
class BalanceStats:
    num_micro_batches: int
    max_tokens: int          # largest micro-batch token sum
    mean_tokens: float       # mean micro-batch token sum
    imbalance: float         # max / mean (1.0 = perfect; 1.0 for an empty plan)


def balance_stats(lengths: list[int], plan: list[list[int]]) -> BalanceStats:
    sums = [sum(lengths[i] for i in b) for b in plan]
    if not sums:
        return BalanceStats(0, 0, 0.0, 1.0)
    mean = sum(sums) / len(sums)
    return BalanceStats(len(sums), max(sums), mean, max(sums) / mean if mean > 0 else 1.0)
