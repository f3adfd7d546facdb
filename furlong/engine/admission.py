"""Admitted waiting work -> the step's prefill items (the scheduler picked what fits; this builds it).

A new request becomes its n sequences, its prompt's pages taken; a preempted sequence or a continuation
prefills from its first uncached token into pages it grows. New requests with the same prompt (a
`shared_key`, scheduler.py) join the first one's item: one prefill, their sequences forked from its
pages. A prompt's forks and joiners form one cascade group (Sequence.fork_group = the first one's
serial; cascade.py). The forks' tables, and the page copies the runner makes after the prefill, are
made once every item holds its own pages, as when the fork followed the prefill.
"""
from __future__ import annotations

import itertools
from typing import Callable

from furlong.engine.block_manager import BlockManager
from furlong.engine.plan import PrefillItem
from furlong.engine.sequence import Request, Sequence, new_sequences


def prefill_items(picked: list[Request | Sequence], blocks: BlockManager,
                  shared_key: Callable[[Request | Sequence], tuple[int, ...] | None],
                  serials: itertools.count) -> list[PrefillItem]:
    """The prefill items of `picked` (in admission order); each sequence gets the next of `serials`."""
    out: list[PrefillItem] = []
    hosts: dict[tuple[int, ...], PrefillItem] = {}
    for item in picked:
        key = shared_key(item)
        if isinstance(item, Request) and key in hosts:
            seqs = new_sequences(item)
            hosts[key].sequences.extend(seqs)
        elif isinstance(item, Request):
            seqs = new_sequences(item)
            blocks.grow(seqs[0].block_table, item.num_tokens)
            out.append(PrefillItem(sequences=seqs, token_ids=list(seqs[0].token_ids), page_copies=[]))
            if key is not None:
                hosts[key] = out[-1]
        else:
            blocks.grow(item.block_table, item.num_tokens)
            seqs = [item]
            out.append(PrefillItem(sequences=seqs, token_ids=item.token_ids[item.num_cached:], page_copies=[],
                                   start=item.num_cached))
        for s in seqs:
            s.serial = next(serials)
        if isinstance(item, Request):   # a prompt's forks, a shared prompt's joiners with them: one cascade group
            origin = (hosts[key].sequences[0] if key is not None else seqs[0]).serial
            for s in seqs:
                s.fork_group = origin
    for item in out:          # after every prompt's own pages, as when the fork followed the prefill
        seqs = item.sequences
        if len(seqs) > 1:
            tables, item.page_copies = blocks.fork(seqs[0].block_table, len(item.token_ids), len(seqs))
            for s, t in zip(seqs, tables):
                s.block_table = t
    return out
