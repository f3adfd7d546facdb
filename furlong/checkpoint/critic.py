"""The critic's checkpoints, beside the actor's (docs/design.md §8).

The critic goes through the actor's atomic machinery (store.py: DCP shards of model and
optimizer, scheduler, the tracker written last) into a directory of its own, --critic-save,
by default --save + "_critic": miles' default, a sibling so that the two trackers never
clobber each other. It is saved BEFORE the actor's checkpoint of the same rollout, so that
whenever the actor's iter_N is complete the critic's iter_N is too, and a resume loads the
critic at exactly the actor's iteration (not the critic tracker's latest): the two always
match, also after a crash between the two saves or with --ckpt-step.

Resume reads --critic-load, by default --load + "_critic". miles falls back to --load itself,
because its --load is also the initial-weights checkpoint both models start from; furlong's
critic starts from an HF checkpoint, and --load only ever names a training run.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from furlong.checkpoint.store import SaveError, iter_dir, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from furlong.trainer.critic import Critic


def check_critic_resume(critic_load: str, iteration: int) -> None:
    """ValueError naming --critic-load unless it holds the critic of the actor's iteration `iteration`."""
    path = iter_dir(critic_load, iteration - 1)
    if not (path / "trainer.pt").is_file():
        raise ValueError(f"--critic-load: no critic checkpoint {path} for iteration {iteration} of --load "
                         f"(a ppo run saves its critic beside the actor's checkpoints)")


def save_critic(critic_save: str, critic: Critic, rollout_id: int) -> Path:
    """Save the critic after `rollout_id` into `critic_save` (every rank calls; before the actor's save, see above)."""
    try:
        return save_checkpoint(critic_save, critic, rollout_id)
    except SaveError as e:
        raise SaveError(str(e).replace("--save:", "--critic-save:", 1)) from e


def load_critic(critic_load: str, critic: Critic, iteration: int) -> None:
    """Restore the critic of the actor's iteration `iteration` from `critic_load` (every rank calls)."""
    try:
        load_checkpoint(critic_load, critic, iteration)
    except ValueError as e:
        raise ValueError(str(e).replace("--load:", "--critic-load:", 1)) from e
