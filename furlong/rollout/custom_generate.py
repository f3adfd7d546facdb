"""--custom-generate-function-path: a user's async function turns one sample into a finished sample.

miles' flag and call (its "legacy" form, used by its recipes):

    async def generate(args: GenerateArgs, sample: Sample, sampling_params: SamplingParams) -> Sample

called once per sample, all of a rollout's samples concurrently on one event loop; every call to
`args.engine` joins the same continuous batch (engine/async_front.py). The function may call the
engine as often as it needs: one turn, several turns with tool or environment output in between.

It READS  sample.prompt (.token_ids [P], .text, .raw messages, .label, .metadata incl. "tools"),
          sample.tokens (prompt + response so far), sample.group_id, sample.index, sample.metadata
          (a copy of the prompt's), and sampling_params (the rollout's, seeded for this sample; change
          them with dataclasses.replace).
It SETS   response_ids [R] (model and tool tokens in context order), response_text,
          rollout_log_probs [R] (the engine's for model tokens, 0.0 for tool tokens),
          loss_mask [R] (1 model token, 0 tool/environment token: kept out of the loss, KL and
          entropy), status (Sample.Status.COMPLETED | TRUNCATED | ABORTED | FAILED), optionally reward
          (left None, the reward function scores the sample afterwards, as miles) and metadata
          (an int metadata["num_tool_calls"] is logged as the share of samples that called a tool:
          rollout/tool_call_ratio, eval/<name>/tool_call_ratio).
          `sample.add_model_tokens(turn.token_ids, turn.log_probs, turn.text)` and
          `sample.add_tool_tokens(ids, text)` keep these fields consistent.
Deviations from miles: `args` is GenerateArgs below (furlong has no miles Namespace and no HTTP
router: the engine is `args.engine`); the prompt tokens are fixed by the data set (tools go into them
through --tool-key and the chat template), so a function extends the response, never the prompt;
a function returns one Sample (miles also allows a list).

Failures, each one line naming the function and the sample (group, index): an exception, more
than --custom-generate-timeout seconds (only awaits can be interrupted: a function that blocks the
event loop blocks the batch), a return value that is not a Sample, inconsistent lengths, no response
tokens, or more than the context limit of tokens. --custom-generate-on-error stop (default) ends the
run (GenerateError, exit 1); drop drops the sample's group and counts it
(rollout/custom_generate/num_failed).
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from furlong.engine.async_front import AsyncEngine
from furlong.engine.sampling import SamplingParams
from furlong.rollout.rollout import RolloutError
from furlong.types import Sample

GenerateFn = Callable[["GenerateArgs", Sample, SamplingParams], Awaitable[Sample]]


class GenerateError(RolloutError):
    """A custom generate function failed on a sample (one line naming both)."""


@dataclass
class GenerateArgs:
    """What a custom generate function gets as miles' `args`."""
    engine: AsyncEngine              # await engine.generate(ids, sampling) / engine.conversation(seed)
    tokenizer: Any                   # the run's HF tokenizer
    max_context_len: int             # prompt + response tokens a sample may reach
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # --apply-chat-template-kwargs
    evaluation: bool = False         # an eval set's sample, not a training one
    config: Any = None               # the run's Config (its flags), when the run has one


@dataclass(frozen=True)
class GenerateConfig:
    """What the custom generate/rollout paths read of the flags (config_map.generate_config)."""
    max_context_len: int | None      # --rollout-max-context-len (None: the engine's max_model_len)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # --apply-chat-template-kwargs, parsed
    flags: Any = None                # the run's Config: GenerateArgs.config for user functions (miles' args)


@dataclass
class GenerateSpec:
    fn: GenerateFn
    name: str                        # how errors name it: the flag's path or the callable's qualname
    timeout: float | None            # seconds per sample (--custom-generate-timeout; None: none)
    drop_failed: bool                # --custom-generate-on-error drop


def check_generate_fn(fn: Callable[..., Any], name: str, flag_name: str) -> GenerateFn:
    """The function, after checking it is `async def` and takes (args, sample, sampling_params)."""
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ValueError(f"{flag_name}: {name} must be an async function (async def)")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ValueError(f"{flag_name}: {name} must take (args, sample, sampling_params)") from None
    return fn


def _where(sample: Sample) -> str:
    return f"sample (group {sample.group_id}, index {sample.index})"


def check_sample(name: str, given: Sample, out: Any, max_context_len: int) -> Sample:
    """`out` if it is a usable finished sample, else GenerateError naming the function and the sample."""
    bad = lambda why: GenerateError(f"custom generate function {name}: {why} on {_where(given)}")  # noqa: E731
    if not isinstance(out, Sample):
        raise bad(f"returned {type(out).__name__}, not a furlong Sample")
    r = len(out.response_ids)
    if r == 0:
        raise bad("returned no response tokens")
    if len(out.rollout_log_probs) != r:
        raise bad(f"rollout_log_probs has {len(out.rollout_log_probs)} entries for {r} response tokens")
    if out.loss_mask is not None and (len(out.loss_mask) != r or any(m not in (0, 1) for m in out.loss_mask)):
        raise bad(f"loss_mask must be {r} entries of 0/1, got {len(out.loss_mask)}")
    if out.num_tokens > max_context_len:
        raise bad(f"returned {out.num_tokens} tokens, over the context limit of {max_context_len}")
    if out.finish_reason == Sample.Status.PENDING.value:
        out.status = Sample.Status.COMPLETED
    return out


async def run_generate(spec: GenerateSpec, args: GenerateArgs, sample: Sample, sampling: SamplingParams) -> Sample:
    """One sample through the custom function, bounded and checked (GenerateError on any failure)."""
    try:
        out = await asyncio.wait_for(spec.fn(args, sample, sampling), spec.timeout)
    except asyncio.TimeoutError:
        raise GenerateError(f"custom generate function {spec.name} took more than --custom-generate-timeout "
                            f"{spec.timeout:g}s on {_where(sample)}") from None
    except GenerateError:
        raise
    except Exception as e:   # the user's code: which call failed, in one line
        raise GenerateError(f"custom generate function {spec.name} raised on {_where(sample)}: "
                            f"{type(e).__name__}: {e}".splitlines()[0]) from e
    return check_sample(spec.name, sample, out, args.max_context_len)
