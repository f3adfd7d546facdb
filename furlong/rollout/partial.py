"""Partial rollouts (miles' --partial-rollout and --mask-offpolicy-in-partial-rollout): the paused groups.

Without them, once a rollout has kept --rollout-batch-size groups, every group still generating is
aborted and its tokens are thrown away. With --partial-rollout those groups are paused instead: each
sample keeps what it has (a finished sample its whole response, an unfinished one its tokens so far
with their engine log-probs, one never started nothing), the groups go into this buffer, and the next
rollout draws them before any new prompt (miles' data buffer, consumed first) and continues their
unfinished samples with the new weights. The engine gets prompt + tokens so far (Request.resume_ids)
under the sample's own max_new_tokens budget and its own sampling noise (rollout/in_flight.py), so
a sample resumed under unchanged weights yields exactly the tokens it would have without the pause.
A group is paused and resumed whole (the filter and GRPO's baseline need all n samples): it is kept
or dropped once, when its last sample finishes, in whichever rollout that is; a group still
unfinished then is paused again.

The earlier tokens keep their rollout log-probs (the older policy's). By default they train like
any token, --use-tis weighing the mismatch; with --mask-offpolicy-in-partial-rollout every response
token a sample holds when its group is resumed gets loss mask 0, finished samples of the group
included, so only tokens the current rollout's weights generated train: miles' rule
(sglang_rollout.generate_and_rm: `loss_mask = [0] * response_length` before generating on).

Groups that finished in the engine step that completed the batch are not kept: they are dropped,
as in miles, which collects only the groups still pending when it aborts.

The buffer is the same on every rank (each rank's paused groups are exchanged in rank order) and is
saved in the run's checkpoint (checkpoint/run.py, inside the atomic iteration directory), so a
resumed run continues every paused group; `state_dict` holds plain values only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from furlong.types import Group, Prompt, Sample

START_KEY = "start_rollout_id"   # Sample.metadata: the rollout that first drew a resumed sample's group (miles' key)


@dataclass
class PausedGroup:
    """One group at the end of the rollout that paused it."""
    group: Group               # its n samples: finish_reason "stop"/"length" done, "abort" stopped mid-way
                               # (tokens so far), "pending" never started (no tokens)
    seed: int                  # the request seed its first rollout drew it with: resumed samples keep their noise
    start_rollout_id: int      # the rollout that first drew it

    @property
    def num_samples(self) -> int:
        return len(self.group.samples)


def offpolicy_mask(num_prior: int, num_tokens: int) -> list[int]:
    """[num_tokens] loss mask of a resumed sample under --mask-offpolicy-in-partial-rollout: 0 on the
    `num_prior` tokens it had when resumed, 1 on those generated after."""
    return [0] * num_prior + [1] * (num_tokens - num_prior)


class PausedGroups:
    """The buffer of paused groups, oldest first: `take` draws, `put` adds a rollout's paused groups."""

    def __init__(self) -> None:
        self.groups: list[PausedGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def num_samples(self) -> int:
        return sum(pg.num_samples for pg in self.groups)

    def take(self, num: int) -> list[PausedGroup]:
        """The oldest `num` groups (fewer when the buffer holds fewer), removed from the buffer."""
        out, self.groups = self.groups[:num], self.groups[num:]
        return out

    def put(self, groups: list[PausedGroup]) -> None:
        self.groups.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [_group_state(pg) for pg in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [_group_from_state(g) for g in state["groups"]]


def _group_state(pg: PausedGroup) -> dict[str, Any]:
    samples = pg.group.samples
    return {"seed": pg.seed, "start_rollout_id": pg.start_rollout_id, "group_id": pg.group.group_id,
            "prompt": dataclasses.asdict(samples[0].prompt),
            "samples": [{f.name: getattr(s, f.name) for f in dataclasses.fields(Sample) if f.name != "prompt"}
                        for s in samples]}


def _group_from_state(state: dict[str, Any]) -> PausedGroup:
    prompt = Prompt(**state["prompt"])
    samples = [Sample(prompt=prompt, **s) for s in state["samples"]]
    return PausedGroup(group=Group(group_id=int(state["group_id"]), samples=samples), seed=int(state["seed"]),
                       start_rollout_id=int(state["start_rollout_id"]))
