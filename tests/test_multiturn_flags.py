"""miles' data/reward/context flags for multi-turn runs: --apply-chat-template-kwargs, --tool-key,
--metadata-key, --reward-key, --rollout-max-context-len."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import build_tokenizer  # noqa: E402

from furlong.config import Config  # noqa: E402
from furlong.config_checks import chat_template_kwargs, validate  # noqa: E402
from furlong.data import DataError, PromptDataset  # noqa: E402
from furlong.engine.sampling import SamplingParams  # noqa: E402
from furlong.rewards.keyed import KeyedReward  # noqa: E402
from furlong.rewards.registry import RewardError, compute_rewards  # noqa: E402
from furlong.rollout.rollout import RolloutConfig, context_cap  # noqa: E402
from furlong.types import Prompt, Sample  # noqa: E402

TEMPLATE = ("{% if tools %}[{{ tools | length }} tools: {{ tools[0]['function']['name'] }}]{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_tools_metadata_and_template_kwargs_reach_the_prompt(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    rows = [{"input": [{"role": "user", "content": "a"}], "tools": TOOLS, "metadata": {"id": 7}},
            {"input": [{"role": "user", "content": "b"}], "tools": json.dumps(TOOLS), "metadata": '{"id": 8}'},
            {"input": [{"role": "user", "content": "c"}]}]
    ds = PromptDataset(write(tmp_path / "d.jsonl", rows), tok, apply_chat_template=True, tool_key="tools",
                       metadata_key="metadata", chat_template_kwargs={"enable_thinking": False})
    p = ds.all()
    assert p[0].text == "[1 tools: calculator][no think]<user>a<assistant>"
    assert p[1].text == p[0].text.replace("a<", "b<")
    assert p[0].metadata == {"id": 7, "tools": TOOLS} and p[1].metadata["id"] == 8
    assert p[2].text == "[no think]<user>c<assistant>" and p[2].metadata == {}
    bad = [{"input": "x", "tools": "{not json"}]
    with pytest.raises(DataError, match=r"row 1: key 'tools' \(--tool-key\): not valid JSON"):
        PromptDataset(write(tmp_path / "b.jsonl", bad), tok, tool_key="tools")
    with pytest.raises(DataError, match=r"key 'metadata' \(--metadata-key\): expected a dict, got list"):
        PromptDataset(write(tmp_path / "c.jsonl", [{"input": "x", "metadata": [1]}]), tok, metadata_key="metadata")


@pytest.mark.parametrize("value,why", [("{oops", "not JSON"), ("[1, 2]", "expected a JSON object, got list")])
def test_template_kwargs_must_be_a_json_object(value, why):
    cfg = Config()
    cfg.data.hf_checkpoint, cfg.data.prompt_data, cfg.reward.rm_type = "c", "p", "math"
    cfg.data.apply_chat_template_kwargs = value
    with pytest.raises(ValueError, match=f"--apply-chat-template-kwargs: {why}"):
        validate(cfg)
    cfg.data.apply_chat_template_kwargs = '{"enable_thinking": false}'
    assert chat_template_kwargs(cfg) == {"enable_thinking": False}


def _sample() -> Sample:
    return Sample(prompt=Prompt(0, "q", "q", [1], "4"), group_id=3, index=1, response_ids=[2], response_text="4",
                  rollout_log_probs=[0.0], finish_reason="stop")


def test_reward_key_picks_the_trained_value():
    s = _sample()
    assert compute_rewards(KeyedReward(lambda x: {"acc": 1.0, "fmt": 0.5}, "acc"), [s]) == [1.0]
    assert s.metadata["rewards"] == {"acc": 1.0, "fmt": 0.5}

    async def async_scores(x):
        return {"acc": 0.25}
    assert compute_rewards(KeyedReward(async_scores, "acc"), [_sample()]) == [0.25]
    with pytest.raises(RewardError, match=r"--reward-key: .* returned a dict without 'acc' for sample \(group 3"):
        compute_rewards(KeyedReward(lambda x: {"fmt": 1.0}, "acc"), [_sample()])


def test_context_len_caps_each_request():
    spec = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=1,
                       sampling=SamplingParams(max_new_tokens=10), seed=0, max_context_len=30)
    assert context_cap(spec, 25) == [5, 5] and context_cap(spec, 20) is None
    assert context_cap(dataclasses.replace(spec, max_context_len=None), 25) is None
