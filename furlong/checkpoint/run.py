"""A training run's checkpoint: the critic (ppo), then the actor with the prompt sampler's position
and, with --partial-rollout, the paused groups (rollout/partial.py) beside it in trainer.pt, so they
are written and renamed into place with the rest of the iteration (atomic) and a resumed run loses none.

One save and one resume for the loop and run set-up, so the order rule lives in one place: the
critic's iter_N is written BEFORE the actor's, so a complete actor iter_N implies the critic's
(checkpoint/critic.py says why); on resume both load the actor's chosen iteration.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.checkpoint.store import ResumeState, load_checkpoint, save_checkpoint
from furlong.checkpoint.critic import load_critic, save_critic

if TYPE_CHECKING:
    from furlong.data import PromptDataset
    from furlong.rollout.partial import PausedGroups
    from furlong.trainer.actor import Actor
    from furlong.trainer.critic import Critic


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and when a run saves, and where it resumes from (config_map.checkpoint_config resolves the
    critic's defaults)."""
    save: str | None                 # --save: the actor's checkpoints (None: never saved)
    save_interval: int | None        # --save-interval: after every K-th rollout (the final state is saved anyway)
    load: str | None                 # --load: the run to resume
    critic_save: str | None          # --critic-save (default --save + "_critic")
    critic_load: str | None          # --critic-load (default --load + "_critic")
    source: str | None               # --hf-checkpoint, recorded in the actor's checkpoints for `furlong export`


PAUSED_KEY = "paused_groups"   # in the sampler state: PausedGroups.state_dict()


def save_run(cfg: CheckpointConfig, actor: Actor, critic: Critic | None, dataset: PromptDataset,
             rollout_id: int, paused: PausedGroups | None = None) -> Path:
    """Save after `rollout_id` into --save (every rank calls); returns the actor's iter_* directory."""
    if critic is not None:
        save_critic(cfg.critic_save, critic, rollout_id)
    sampler = dataset.state_dict()
    if paused is not None:
        sampler[PAUSED_KEY] = paused.state_dict()
    return save_checkpoint(cfg.save, actor, rollout_id, sampler_state=sampler, source=cfg.source,
                           lora=actor.cfg.lora)


def load_run(cfg: CheckpointConfig, actor: Actor, critic: Critic | None, dataset: PromptDataset,
             iteration: int, paused: PausedGroups | None = None) -> ResumeState:
    """Restore iteration `iteration` of --load (checked by run set-up) into actor, critic, dataset and the
    paused groups (none when the checkpoint was saved without --partial-rollout)."""
    state = load_checkpoint(cfg.load, actor, iteration)
    if critic is not None:
        load_critic(cfg.critic_load, critic, iteration)
    _restore_sampler(state.sampler_state, dataset, paused)
    return state


def resume_rollouts(trainer_state: dict, dataset: PromptDataset, paused: PausedGroups | None,
                    start_rollout_id: int | None) -> int:
    """--debug-rollout-only with --load: no trainer to restore, only the prompt sampler's position and the
    paused groups of the checkpoint's trainer.pt (`trainer_state`); the first rollout id to run
    (--start-rollout-id wins, as on a resume)."""
    _restore_sampler(trainer_state["sampler"], dataset, paused)
    return start_rollout_id if start_rollout_id is not None else int(trainer_state["rollout_id"]) + 1


def _restore_sampler(sampler_state: dict, dataset: PromptDataset, paused: PausedGroups | None) -> None:
    dataset.load_state_dict(sampler_state)
    if paused is not None:
        paused.load_state_dict(sampler_state.get(PAUSED_KEY, {"groups": []}))
