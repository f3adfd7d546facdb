"""furlong from Python (a script, a notebook): `furlong train` with callables in place of module paths.

    from furlong.api import train, trl_reward

    def reward(sample):                                  # furlong's reward: one Sample -> float
        return float(sample.label in sample.response_text)

    async def generate(args, sample, sampling_params):   # optional: multi-turn, tools (custom_generate.py)
        ...

    train("--hf-checkpoint ckpt --prompt-data train.jsonl --input-key messages --label-key label "
          "--apply-chat-template --num-rollout 10 --rollout-batch-size 8 --n-samples-per-prompt 4",
          reward=reward, generate=generate)
    train([...], reward=trl_reward(my_trl_reward_fn, label_name="solution"))

`train` parses the flags with the CLI's own parser and checks, stands each callable in for its flag
(reward: --custom-rm-path, generate: --custom-generate-function-path, rollout: --rollout-function-path;
each wins over the flag, as --custom-rm-path wins over --rm-type), and launches what `furlong train`
launches; nothing else differs, so a run through `train` equals the CLI run that names the same
functions by path (tests/test_api.py). Errors are raised as exceptions (the CLI prints them as one
line). With --actor-num-gpus-per-node > 1 the callables go to spawned workers: they must be picklable
(module-level functions, not lambdas or closures).

`trl_reward` adapts a TRL-style reward function, `fn(completions, prompts, **kwargs) -> list[float]`
called on a batch of one: `completions` and `prompts` are strings, or message lists when the prompt was
chat messages (TRL's conversational format: the completion is one assistant message); kwargs carry the
sample's label under `label_name`, `completion_ids`, and the sample's metadata keys (TRL passes the
data set's other columns the same way).
"""
from __future__ import annotations

import shlex
from typing import Any, Callable, Sequence

from furlong.types import Sample


def train(flags: str | Sequence[str], *, reward: Callable[..., Any] | None = None,
          generate: Callable[..., Any] | None = None, rollout: Callable[..., Any] | None = None) -> int:
    """Run `furlong train <flags>` with these callables (module docstring); returns the exit status
    (0, or 128 + signal when a SIGINT/SIGTERM stopped it after a whole step)."""
    from furlong.cli import parse_config
    from furlong.launch.entry import launch
    from furlong.run.user_functions import UserFunctions
    argv = shlex.split(flags) if isinstance(flags, str) else list(flags)
    cfg = parse_config(argv, "train", reward_given=reward is not None)
    return launch("train", cfg, UserFunctions(reward=reward, generate=generate, rollout=rollout))


class trl_reward:   # noqa: N801 - used like a function: trl_reward(fn)
    """A TRL-style batched reward function as furlong's per-sample reward (module docstring)."""

    def __init__(self, fn: Callable[..., Any], label_name: str = "label"):
        self.fn, self.label_name = fn, label_name
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__name__

    def __call__(self, sample: Sample) -> float:
        raw = sample.prompt.raw
        conversational = isinstance(raw, list)
        completion = [{"role": "assistant", "content": sample.response_text}] if conversational \
            else sample.response_text
        extra = {k: [v] for k, v in {**sample.prompt.metadata, **sample.metadata}.items()}
        out = self.fn(completions=[completion], prompts=[raw if conversational else sample.prompt.text],
                      completion_ids=[list(sample.response_ids)], **{**extra, self.label_name: [sample.label]})
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            raise ValueError(f"trl_reward: {self.__qualname__} returned {type(out).__name__}; a TRL reward "
                             "function returns a list with one reward per completion")
        return out[0]
