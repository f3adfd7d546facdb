"""KV-cache pages: allocation, sharing between the samples of a prompt, and freeing.

Plain Python bookkeeping over `num_blocks` pages of `block_size` token slots;
the tensors live in the model runner. Page 0 is reserved as the scratch page
that the padded rows of a CUDA-graph batch write into, so it is never handed out.

Sharing: the n samples of a request are forked from one prefilled prompt. Its
FULL pages are shared (reference counts); the partly filled last page is
copied for every sample but the first (`fork` returns the (src, dst) page
copies for the runner to perform), since each sample writes its own tokens
there. A shared page is freed when its last sequence lets go of it.
"""
from __future__ import annotations


def pages_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"--rollout-kv-fraction: the KV cache holds {num_blocks} pages; need at least 2 "
                             "(raise the fraction or free GPU memory)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def _take(self) -> int:
        page = self.free.pop()
        self.ref_counts[page] = 1
        return page

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return pages_for(num_tokens, self.block_size) - len(table) <= len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it holds `num_tokens` slots (caller checked can_grow)."""
        need = pages_for(num_tokens, self.block_size) - len(table)
        if need > len(self.free):
            raise RuntimeError(f"BlockManager.grow: need {need} pages, {len(self.free)} free")
        for _ in range(need):
            table.append(self._take())

    def fork_cost(self, num_prompt_tokens: int, n: int) -> int:
        """Extra pages that forking a prompt into n samples takes (the copied last page)."""
        return (n - 1) if num_prompt_tokens % self.block_size else 0

    def fork(self, table: list[int], num_tokens: int, n: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """n tables over the same first `num_tokens` slots of `table` (which the first sample
        keeps). Returns (tables, page copies (src, dst) the runner must make)."""
        full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        tables, copies = [table], []
        for _ in range(n - 1):
            t = list(table[:full])
            for page in t:
                self.ref_counts[page] += 1
            if partial:
                dst = self._take()
                copies.append((table[full], dst))
                t.append(dst)
            tables.append(t)
        return tables, copies

    def release(self, table: list[int]) -> None:
        for page in table:
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free.append(page)
            elif self.ref_counts[page] < 0:
                raise RuntimeError(f"BlockManager.release: page {page} freed twice")
        table.clear()
