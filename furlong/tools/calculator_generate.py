"""A multi-turn generate function with the calculator tool (`--custom-generate-function-path
furlong.tools.calculator_generate.generate`).

Per sample, up to MAX_TURNS model turns in one conversation (its KV reused between turns):
the model answers; if its turn ended with EOS and holds <tool_call> blocks (tool_calls.py), each call
runs (calculator.py; an unknown tool or a bad call is answered with an error message), the results
are appended as tool tokens (loss mask 0) through the chat template, and the model continues. The
sample ends at a turn without tool calls (COMPLETED), at a turn cut by its length (TRUNCATED), or
when the next turn would have no room in the context (TRUNCATED). sample.metadata["num_tool_calls"]
counts the calls. The prompt should carry the tool's spec: a data column named by --tool-key holding
[calculator.SPEC] (tasks/calculator_task.py writes it), rendered by the chat template.
"""
from __future__ import annotations

from furlong.engine.sampling import SamplingParams
from furlong.rollout.custom_generate import GenerateArgs
from furlong.tools.calculator import calculator
from furlong.tools.tool_calls import ToolCall, parse_tool_calls, tool_result_ids
from furlong.types import Sample

MAX_TURNS = 4


def run_tool(call: ToolCall) -> str:
    if call.error is not None:
        return f"error: {call.error}"
    if call.name != "calculator":
        return f"error: unknown tool {call.name!r}"
    expression = call.arguments.get("expression")
    return calculator(expression) if isinstance(expression, str) else "error: missing string 'expression'"


async def generate(args: GenerateArgs, sample: Sample, sampling_params: SamplingParams) -> Sample:
    sample.metadata["num_tool_calls"] = 0
    async with args.engine.conversation(sampling_params.seed or 0) as conv:
        for _ in range(MAX_TURNS):
            turn = await conv.generate(sample.tokens, sampling_params)
            sample.add_model_tokens(turn.token_ids, turn.log_probs, turn.text)
            if turn.finish_reason != "stop":
                sample.status = Sample.Status.TRUNCATED
                return sample
            calls = parse_tool_calls(turn.text)
            if not calls:
                sample.status = Sample.Status.COMPLETED
                return sample
            ids, text = tool_result_ids(args.tokenizer, calls, [run_tool(c) for c in calls],
                                        args.chat_template_kwargs)
            sample.metadata["num_tool_calls"] += len(calls)
            if sample.num_tokens + len(ids) >= args.max_context_len:
                sample.status = Sample.Status.TRUNCATED
                return sample
            sample.add_tool_tokens(ids, text)
    sample.status = Sample.Status.TRUNCATED     # still calling tools after MAX_TURNS turns
    return sample
