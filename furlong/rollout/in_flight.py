"""This rank's groups in flight on its engine during one rollout: submit, collect, stop (abort or pause).

A new group is one engine request of n samples (its prompt prefilled once). A paused group
(rollout/partial.py) comes back as one request of n = 1 per unfinished sample, whose resume_ids are
its tokens so far (the engine keeps them as the response: log-probs, max_new_tokens budget, stop
strings across the pause) and whose noise is its own (the group's seed, `first_sample` = its index);
a paused group none of whose samples started is one request of n again. Its finished samples are
kept as they are. A group is finished, and handed back by `collect`, once all n samples are.

`stop` aborts everything still in flight; with `pause` it returns the unfinished groups as
PausedGroups (a sample that never ran again in this rollout keeps its earlier tokens).
Token counts are of this rollout only: a resumed sample's earlier tokens were counted when made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Completion, Request
from furlong.rollout.partial import START_KEY, PausedGroup, offpolicy_mask
from furlong.types import Group, Prompt, Sample

if TYPE_CHECKING:
    from furlong.engine import Engine


def completion_sample(prompt: Prompt, group_id: int, c: Completion, index: int | None = None) -> Sample:
    return Sample(prompt=prompt, group_id=group_id, index=c.index if index is None else index,
                  response_ids=c.token_ids, response_text=c.text, rollout_log_probs=c.log_probs,
                  finish_reason=c.finish_reason, metadata=dict(prompt.metadata))


def to_group(prompt: Prompt, group_id: int, completions: list[Completion]) -> Group:
    return Group(group_id=group_id, samples=[completion_sample(prompt, group_id, c)
                                             for c in sorted(completions, key=lambda c: c.index)])


@dataclass
class FinishedGroup:
    group: Group
    num_new_tokens: int             # response tokens generated in this rollout
    num_offpolicy_tokens: int = 0   # response tokens it had when resumed (earlier rollouts' weights)


@dataclass
class _Group:
    prompt: Prompt
    group_id: int                    # within this rollout
    seed: int
    start_rollout_id: int
    caps: list[int]                  # [n] each sample's max_new_tokens
    done: list[Sample | None]        # [n] finished samples (None: generating)
    prior: list[Sample | None]       # [n] the paused sample a resumed one continues (None: new)
    request_ids: list[int] = field(default_factory=list)

    def num_prior(self, j: int) -> int:
        return 0 if self.prior[j] is None else len(self.prior[j].response_ids)


class InFlight:
    def __init__(self, engine: Engine, sampling: SamplingParams, rollout_id: int, mask_offpolicy: bool = False):
        self.engine, self.sampling, self.rollout_id = engine, sampling, rollout_id
        self.mask_offpolicy = mask_offpolicy    # --mask-offpolicy-in-partial-rollout
        self.requests: dict[int, tuple[_Group, int | None]] = {}   # id -> (group, sample index; None: all n)
        self.ready: list[_Group] = []           # resumed groups with nothing left to generate

    def _add(self, g: _Group, index: int | None, **request) -> None:
        rid = self.engine.new_request_id()
        self.engine.add(Request(request_id=rid, params=self.sampling, seed=g.seed, **request))
        self.requests[rid] = (g, index)
        g.request_ids.append(rid)

    def submit(self, prompt: Prompt, group_id: int, seed: int, n: int, caps: list[int] | None) -> None:
        """A new group: one request of n samples (caps: per-sample max_new_tokens, None: the sampling's)."""
        g = _Group(prompt, group_id, seed, self.rollout_id, caps or [self.sampling.max_new_tokens] * n,
                   [None] * n, [None] * n)
        self._add(g, None, prompt_ids=prompt.token_ids, n=n, sample_max_new_tokens=caps)

    def resume(self, paused: PausedGroup, group_id: int, caps: list[int] | None) -> None:
        """A paused group: its unfinished samples continue (module docstring)."""
        samples, prompt = paused.group.samples, paused.group.samples[0].prompt
        n = len(samples)
        g = _Group(prompt, group_id, paused.seed, paused.start_rollout_id,
                   caps or [self.sampling.max_new_tokens] * n, [None] * n, list(samples))
        if all(s.finish_reason == "pending" and not s.response_ids for s in samples):
            g.prior = [None] * n         # nothing generated yet: a new request of n, under its old seed
            self._add(g, None, prompt_ids=prompt.token_ids, n=n, sample_max_new_tokens=caps)
            return
        for j, s in enumerate(samples):
            if s.finish_reason in ("stop", "length"):
                g.done[j] = self._resumed(g, j, s.response_ids, s.rollout_log_probs, s.response_text, s.finish_reason)
            elif len(s.response_ids) >= g.caps[j]:    # no budget left (cannot follow an abort; kept for safety)
                g.done[j] = self._resumed(g, j, s.response_ids, s.rollout_log_probs, s.response_text, "length")
            else:
                self._add(g, j, prompt_ids=prompt.token_ids, n=1, sample_max_new_tokens=[g.caps[j]],
                          resume_ids=list(s.response_ids), resume_log_probs=list(s.rollout_log_probs),
                          first_sample=j)
        if not g.request_ids:
            self.ready.append(g)

    def _resumed(self, g: _Group, j: int, ids: list[int], log_probs: list[float], text: str, reason: str) -> Sample:
        """Sample j of a resumed group with its whole response (earlier tokens first)."""
        prior = g.prior[j]
        return Sample(prompt=g.prompt, group_id=g.group_id, index=j, response_ids=list(ids), response_text=text,
                      rollout_log_probs=list(log_probs), finish_reason=reason, reward=prior.reward,
                      loss_mask=offpolicy_mask(g.num_prior(j), len(ids)) if self.mask_offpolicy else None,
                      metadata={**prior.metadata, START_KEY: g.start_rollout_id})

    def _sample(self, g: _Group, index: int | None, c: Completion) -> Sample:
        j = c.index if index is None else index
        if g.prior[j] is None:
            return completion_sample(g.prompt, g.group_id, c, j)
        return self._resumed(g, j, c.token_ids, c.log_probs, c.text, c.finish_reason)

    def _finished(self, g: _Group) -> FinishedGroup:
        for rid in g.request_ids:
            self.requests.pop(rid, None)
        samples = list(g.done)
        old = sum(g.num_prior(j) for j in range(len(samples)))
        return FinishedGroup(Group(g.group_id, samples), sum(len(s.response_ids) for s in samples) - old, old)

    def collect(self, done: list[Completion]) -> list[FinishedGroup]:
        """The groups whose last sample is among `done` (plus resumed groups that had nothing to generate)."""
        out = [self._finished(g) for g in self.ready]
        self.ready = []
        for c in done:
            g, index = self.requests[c.request_id]
            g.done[c.index if index is None else index] = self._sample(g, index, c)
            if all(s is not None for s in g.done):
                out.append(self._finished(g))
        return out

    def stop(self, pause: bool) -> tuple[list[PausedGroup], int]:
        """Abort every request in flight: (the unfinished groups as PausedGroups when `pause`, else [];
        response tokens the aborted samples generated in this rollout)."""
        aborted = self.engine.abort(set(self.requests))
        groups: dict[int, _Group] = {}
        num_new = 0
        for c in aborted:
            g, index = self.requests[c.request_id]
            j = c.index if index is None else index
            g.done[j] = self._sample(g, index, c)
            num_new += len(c.token_ids) - g.num_prior(j)
            groups[id(g)] = g
        for g, _ in self.requests.values():
            groups[id(g)] = g
        self.requests = {}
        if not pause:
            return [], num_new
        out = []
        for g in sorted(groups.values(), key=lambda g: g.group_id):
            samples = [s if s is not None else (g.prior[j] if g.prior[j] is not None else
                                                Sample(prompt=g.prompt, group_id=g.group_id, index=j, response_ids=[],
                                                       response_text="", rollout_log_probs=[], finish_reason="pending",
                                                       metadata=dict(g.prompt.metadata)))
                       for j, s in enumerate(g.done)]
            out.append(PausedGroup(Group(g.group_id, samples), g.seed, g.start_rollout_id))
        return out, num_new
