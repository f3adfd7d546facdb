"""Retained KV: finished sequences whose pages stay in the cache for the next turn of their conversation.

A request with `retain_kv` is parked here when it finishes (its pages kept, not freed). A later
request with `continues` = its id takes it back out (`continuation`): the new sequence keeps the
pages of the longest prefix it shares with the parked tokens, and only the rest of its prompt is
prefilled. The reusable prefix stops

  * before the parked sequence's last token: a token's KV is written when it is fed to the model,
    and the last sampled token never was;
  * one token before the new prompt's end: the prefill must run at least one token, whose logits
    draw the first new token;
  * at a page boundary when the page holding the first new position is shared with another
    sequence (the fork's full prompt pages, block_manager.py): the prefill writes that page, so it
    is recomputed into a fresh page instead of written over under the sharer.

Under memory pressure parked pages go first, oldest first (`evict_oldest`), before any running
sequence is preempted; a continuation whose parked sequence was evicted (or a new session, after
`Engine.release`) prefills its whole prompt, as a preempted sequence is recomputed. Parked pages
are freed when the conversation ends (`drop`).

A continuation keeps its first turn's cascade group (Sequence.fork_group) and the part of that turn's
shared prompt it still holds (`shared_prefix`): the n conversations of a group keep reading their common
first prompt once per decode step in every later turn (cascade.py).
"""
from __future__ import annotations

from furlong.engine.block_manager import BlockManager, pages_for
from furlong.engine.sequence import Request, Sequence, new_sequences


class RetainedKV:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.parked: dict[int, Sequence] = {}     # request id -> finished sequence holding its pages (oldest first)

    def park(self, seq: Sequence) -> None:
        self.drop({seq.request.request_id})       # a reused id: the older conversation's pages go
        self.parked[seq.request.request_id] = seq

    def num_pages(self) -> int:
        return sum(len(s.block_table) for s in self.parked.values())

    def reusable(self, old: Sequence, prompt: list[int]) -> int:
        """Tokens of `prompt` whose KV `old`'s pages hold and the continuation may keep (module docstring)."""
        limit = min(old.num_tokens - 1, len(prompt) - 1)
        k = 0
        while k < limit and old.token_ids[k] == prompt[k]:
            k += 1
        size = self.blocks.block_size
        if k % size and self.blocks.ref_counts[old.block_table[k // size]] > 1:
            k -= k % size
        return k

    def continuation(self, request: Request) -> Sequence:
        """The sequence of a `continues` request: the parked pages of the shared prefix, the rest freed
        (no parked sequence under that id: an empty table, the whole prompt is prefilled)."""
        seq = new_sequences(request)[0]
        seq.shared_prefix = 0   # nothing kept: its whole prompt is prefilled into its own pages
        old = self.parked.pop(request.continues, None)
        if old is not None:
            keep = self.reusable(old, request.prompt_ids)
            num_pages = pages_for(keep, self.blocks.block_size)
            self.blocks.release(old.block_table[num_pages:])
            seq.block_table, seq.num_cached = old.block_table[:num_pages], keep
            # the first turn's shared prompt pages come along: decode still reads them once per group
            seq.fork_group, seq.shared_prefix = old.fork_group, min(old.shared_prefix, keep)
            old.block_table = []
        return seq

    def drop(self, request_ids: set[int]) -> None:
        """Free the pages of these parked sequences (their conversations ended)."""
        for rid in request_ids:
            seq = self.parked.pop(rid, None)
            if seq is not None:
                self.blocks.release(seq.block_table)

    def evict_oldest(self) -> bool:
        """Free the oldest parked sequence's pages; False when none is parked."""
        if not self.parked:
            return False
        self.drop({next(iter(self.parked))})
        return True
