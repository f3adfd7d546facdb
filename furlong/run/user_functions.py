"""The user's functions of a run: from module paths (the CLI's flags) or callables (the Python API).

`UserFunctions` is what api.py hands in; `load_user_functions` turns a run's flags plus those into
the functions the rollout and the loss call, checked before anything is written (preflight.py): a callable
stands for its flag (--custom-rm-path, --custom-generate-function-path, --rollout-function-path)
and wins over it, as a custom reward wins over --rm-type. Either way the run that follows is the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from furlong.config import Config
from furlong.rollout.custom_generate import GenerateSpec, check_generate_fn
from furlong.algorithms.custom_loss import UserLossFunctions
from furlong.run.reward_post_process import RewardPostProcess
from furlong.user_code import load_function, miles_args


@dataclass
class UserFunctions:
    """Callables in place of module paths (api.py); None: the flag's path, if given."""
    reward: Callable[..., Any] | None = None     # fn(sample) -> float | dict (with --reward-key); may be async
    generate: Callable[..., Any] | None = None   # async fn(args, sample, sampling_params) -> Sample
    rollout: Callable[..., Any] | None = None    # fn(args, rollout_id, data_source, evaluation=False) -> groups


@dataclass
class RolloutFunctions:
    generate: GenerateSpec | None          # custom generate (None: the engine's single-turn requests)
    rollout: Callable[..., Any] | None     # replaces the rollout step (None: the streaming rollout)
    rollout_name: str                      # how errors name it
    eval: Callable[..., Any] | None = None # --eval-function-path: replaces eval generation (run/evals.py)
    eval_name: str = ""
    reward_post_process: RewardPostProcess | None = None   # --custom-reward-post-process-path
    loss: UserLossFunctions | None = None  # user functions of the actor's loss (also in its LossConfig)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def load_user_functions(cfg: Config, given: UserFunctions | None) -> RolloutFunctions:
    given = given or UserFunctions()
    r = cfg.rollout
    gen = None
    flag = "--custom-generate-function-path"
    fn = given.generate or (load_function(r.custom_generate_function_path, flag)
                            if r.custom_generate_function_path else None)
    if fn is not None:
        name = r.custom_generate_function_path if given.generate is None else _name(fn)
        gen = GenerateSpec(fn=check_generate_fn(fn, name, flag), name=name, timeout=r.custom_generate_timeout,
                           drop_failed=r.custom_generate_on_error == "drop")
    rollout = given.rollout or (load_function(r.rollout_function_path, "--rollout-function-path")
                                if r.rollout_function_path else None)
    if r.partial_rollout and (gen is not None or rollout is not None):   # the API's callables (flags: config_checks)
        raise ValueError("--partial-rollout: not supported with a custom generate or rollout function")
    rollout_name = "" if rollout is None else (
        r.rollout_function_path if given.rollout is None else _name(rollout))
    path = cfg.eval_set.eval_function_path
    post = None
    if cfg.custom.custom_reward_post_process_path:
        post_path = cfg.custom.custom_reward_post_process_path
        post = RewardPostProcess(fn=load_function(post_path, "--custom-reward-post-process-path"), name=post_path,
                                 args=miles_args(cfg))
    return RolloutFunctions(generate=gen, rollout=rollout, rollout_name=rollout_name,
                            eval=load_function(path, "--eval-function-path") if path else None, eval_name=path or "",
                            reward_post_process=post, loss=load_loss_functions(cfg))


def load_loss_functions(cfg: Config) -> UserLossFunctions | None:
    """The user's loss, TIS and pg-reducer functions (None when none is given); config_map.loss_config puts
    them into the actor's LossConfig."""
    c = cfg.custom
    paths = {"loss": (c.custom_loss_function_path, "--custom-loss-function-path"),
             "tis": (c.custom_tis_function_path, "--custom-tis-function-path"),
             "pg_reducer": (c.custom_pg_loss_reducer_function_path, "--custom-pg-loss-reducer-function-path")}
    if all(path is None for path, _ in paths.values()):
        return None
    fns = {k: load_function(path, flag) if path else None for k, (path, flag) in paths.items()}
    return UserLossFunctions(args=miles_args(cfg), **fns, **{f"{k}_name": path or "" for k, (path, _) in paths.items()},
                             calculate_per_token_loss=cfg.algo.calculate_per_token_loss
                             or cfg.algo.loss_agg_mode == "token-mean")
