"""An asyncio front over the Engine: many coroutines share one continuous batch.

    front = AsyncEngine(engine, max_context_len)
    async with front.conversation(seed) as conv:          # one sample's turns; its KV stays between them
        turn = await conv.generate(token_ids, sampling)   # token_ids: the whole conversation so far
    await front.serve(main)                               # steps the engine until `main` is done

Each `generate` adds a Request to the engine and awaits a future. One driver (`serve`, or a
caller's own loop over `tick`) steps the engine whenever it has work; the completions of a step
resolve their futures, and `tick` then yields to the event loop once so that every woken
coroutine runs up to its next await (a tool call, its next turn's submit) before the next step,
which admits the new turns together with the running rows. Nothing runs in parallel: tools and
rewards run between engine steps on the same thread. A coroutine that blocks without awaiting
blocks the whole batch.

A conversation's turns are a chain of requests with `retain_kv`, each `continues` the previous
(retained.py): only the tokens appended since the last turn are prefilled. Leaving the
conversation (or cancelling a coroutine mid-turn) frees its pages and aborts its request.
Sampling noise is keyed by (sample seed, position) (sampling.py), so a conversation's tokens do
not depend on KV reuse, batching or the turn split; the per-turn seed is the conversation's.

`max_context_len` (--rollout-max-context-len, at most the engine's max length) caps each turn's
max_new_tokens at what the context has left, as miles does; a turn with no room left returns no
tokens and finish_reason "length".
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Awaitable

from furlong.engine.engine import Engine
from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Completion, Request

IDLE_SECONDS = 0.0005   # the driver's pause when every coroutine is away (e.g. in an async tool) and the engine idles


@dataclass
class Turn:
    """One model turn's output."""
    token_ids: list[int]     # [R] generated tokens, the final EOS/stop token included
    log_probs: list[float]   # [R] engine log-probs (sampling temperature)
    text: str                # decoded, special tokens kept, cut after a stop string
    finish_reason: str       # "stop" | "length" | "abort"


def _turn(c: Completion) -> Turn:
    return Turn(token_ids=c.token_ids, log_probs=c.log_probs, text=c.text, finish_reason=c.finish_reason)


class AsyncEngine:
    def __init__(self, engine: Engine, max_context_len: int | None = None):
        self.engine = engine
        limit = engine.cfg.max_model_len
        self.max_context_len = limit if max_context_len is None else min(max_context_len, limit)
        self._futures: dict[int, asyncio.Future] = {}     # request id -> its turn, while in the engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def conversation(self, seed: int) -> Conversation:
        return Conversation(self, seed)

    async def generate(self, token_ids: list[int], sampling: SamplingParams, seed: int = 0) -> Turn:
        """One turn with nothing retained (a single-turn sample)."""
        return await self._run(token_ids, sampling, seed, retain=False, continues=None)[1]

    def _run(self, token_ids: list[int], sampling: SamplingParams, seed: int, retain: bool,
             continues: int | None) -> tuple[int, Awaitable[Turn]]:
        room = self.max_context_len - len(token_ids)
        rid = self.engine.new_request_id()
        if room <= 0:
            return rid, _ready(Turn([], [], "", "length"))
        if sampling.max_new_tokens > room:
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        self.engine.add(Request(rid, list(token_ids), sampling, seed=seed, retain_kv=retain, continues=continues))
        future = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        return rid, self._await(rid, future)

    async def _await(self, rid: int, future: asyncio.Future) -> Turn:
        try:
            return await future
        except asyncio.CancelledError:      # the sample was abandoned (timeout, enough groups kept)
            self._futures.pop(rid, None)
            self.engine.abort({rid})
            raise

    def step(self) -> int:
        """One engine step (if it has work); resolves the futures of the requests that finished in it."""
        if not self.engine.has_work():
            return 0
        done = self.engine.step()
        for c in done:
            future = self._futures.pop(c.request_id, None)
            if future is not None and not future.done():
                future.set_result(_turn(c))
        return len(done)

    async def tick(self) -> None:
        """One engine step, then one pass of the event loop: the woken coroutines submit their next turns."""
        if self.engine.has_work():
            self.step()
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(IDLE_SECONDS)

    async def serve(self, main: Awaitable[Any]) -> Any:
        """Run `main` (e.g. a gather of many samples' coroutines) while stepping the engine for it."""
        task = asyncio.ensure_future(main)
        while not task.done():
            await self.tick()
        return task.result()


async def _value(x: Turn) -> Turn:
    return x


def _ready(x: Turn) -> Awaitable[Turn]:
    return _value(x)


class Conversation:
    """The turns of one sample; its KV stays in the engine from one turn to the next (module docstring)."""

    def __init__(self, front: AsyncEngine, seed: int):
        self.front, self.seed = front, seed
        self.last: int | None = None         # request id of the latest turn (its pages are retained)
        self.num_turns = 0

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Turn:
        rid, pending = self.front._run(token_ids, sampling, self.seed, retain=True, continues=self.last)
        previous, self.last = self.last, rid
        if previous is not None:
            self.front.engine.free({previous})   # already taken over by the continuation, or never parked
        turn = await pending
        self.num_turns += 1
        return turn

    def close(self) -> None:
        if self.last is not None:
            self.front.engine.free({self.last})
            self.last = None

    async def __aenter__(self) -> Conversation:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
