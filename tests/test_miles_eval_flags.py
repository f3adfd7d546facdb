"""miles' eval flags: --eval-config (sets with their own settings), --eval-function-path,
--eval-max-prompt-len, --eval-max-context-len, --eval-min-new-tokens (accepted, noted), through
`furlong train/eval` on CPU, and the config file's checks."""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402

from furlong.cli import parse_config  # noqa: E402
from furlong.config_map import rollout_seed  # noqa: E402
from furlong.eval_set_map import eval_set_configs  # noqa: E402

YAML = """
eval:
  defaults: {n_samples_per_eval_prompt: 2, temperature: 0.5}
  datasets:
    - {name: small, path: %(test)s, max_response_len: 3, rm_type: deterministic_random}
    - {name: big, path: %(test)s, n_samples_per_eval_prompt: 4, top_k: 5}
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = tiny_assets(tmp_path_factory.mktemp("eval_assets"))
    (a / "eval.yaml").write_text(YAML % {"test": a / "data" / "test.parquet"})
    return a


def common(a: Path) -> list[str]:
    return ["--hf-checkpoint", str(a / "ckpt"), "--input-key", "messages", "--label-key", "label",
            "--apply-chat-template", "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--device", "cpu",
            "--rollout-max-response-len", "6"]


def evals(out: Path) -> dict:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x][0]


def test_config_settings_fall_back_set_defaults_flag_rollout(assets):
    cfg = parse_config(["--hf-checkpoint", "x", "--prompt-data", "y", "--rm-type", "math", "--eval-config",
                        str(assets / "eval.yaml"), "--eval-top-p", "0.9", "--rollout-top-k", "7",
                        "--eval-max-context-len", "40", "--eval-max-prompt-len", "50"])
    small, big = eval_set_configs(cfg, rollout_seed(cfg))
    assert (small.n_samples_per_prompt, big.n_samples_per_prompt) == (2, 4)
    assert small.sampling.max_new_tokens == 3 and big.sampling.max_new_tokens == 1024
    assert small.sampling.temperature == 0.5 and small.sampling.top_p == 0.9
    assert small.sampling.top_k == 7 and big.sampling.top_k == 5
    assert small.rm_type == "deterministic_random" and big.rm_type is None
    assert small.max_context_len == 40 and small.max_prompt_len == 39   # room for one response token


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "must contain a mapping"),
    ("eval: {datasets: []}", "defines no datasets"),
    ("eval: {datasets: [{name: a}]}", "needs a `name` and a `path`"),
    ("eval: {datasets: [{name: a, path: p, temprature: 1}]}", "unknown key 'temprature'"),
    ("eval: {datasets: [{name: a, path: p}, {name: a, path: q}]}", "two eval sets are named 'a'"),
    ("eval: {datasets: [{name: a, path: p, custom_generate_function_path: m.f}]}", "not supported yet"),
    ("eval: {datasets: [{name: a, path: p, n_samples_per_eval_prompt: 0}]}", "must be >= 1"),
])
def test_bad_eval_config_is_one_line(assets, tmp_path, capsys, text, needle):
    (tmp_path / "e.yaml").write_text(text)
    code, _, err = run_cli(["eval", *common(assets), "--eval-config", str(tmp_path / "e.yaml"),
                            "--output-dir", str(tmp_path / "o")], capsys)
    assert code == 2
    one_line(err, "--eval-config", needle)


def test_eval_config_sets_run_with_their_own_settings(assets, tmp_path, capsys):
    payload = "base64:" + base64.b64encode((assets / "eval.yaml").read_bytes()).decode()
    for name, value in (("file", str(assets / "eval.yaml")), ("inline", payload)):
        out = tmp_path / name
        code, stdout, err = run_cli(["eval", *common(assets), "--eval-config", value, "--output-dir", str(out),
                                     "--log-passrate", "--eval-min-new-tokens", "2"], capsys)
        assert code == 0, err
        assert "--eval-min-new-tokens 2: accepted and ignored" in err
        small = [json.loads(x) for x in (out / "samples" / "eval_small_0.jsonl").read_text().splitlines()]
        big = (out / "samples" / "eval_big_0.jsonl").read_text().splitlines()
        assert len(small) == 2 * 2 and len(big) == 2 * 4           # prompts x each set's n
        m = json.loads(stdout.strip().splitlines()[-1])
        assert m["eval/big"] == 0.5 and "eval/big-pass@4" in m     # index_reward: half of each group
        assert set(r["reward"] for r in small) <= {0.0, 1.0}        # the set's own rm_type, not index_reward


def test_prompt_and_context_limits(assets, tmp_path, capsys):
    base = ["eval", *common(assets), "--eval-prompt-data", "t", str(assets / "data" / "test.parquet")]
    code, _, err = run_cli([*base, "--eval-max-prompt-len", "3", "--output-dir", str(tmp_path / "p")], capsys)
    assert code == 2
    one_line(err, "all 2 prompts are longer than --eval-max-prompt-len 3")
    from furlong.rollout.eval import _context_cap
    from furlong.engine.sampling import SamplingParams
    assert _context_cap(20, 17, SamplingParams(max_new_tokens=6), 2) == [3, 3]
    assert _context_cap(20, 10, SamplingParams(max_new_tokens=6), 2) is None and _context_cap(None, 1, None, 1) is None
    code, _, err = run_cli([*base, "--eval-max-context-len", "200", "--output-dir", str(tmp_path / "c")], capsys)
    assert code == 0, err


def test_eval_function_path_replaces_generation(assets, tmp_path, capsys):
    out = tmp_path / "f"
    code, stdout, err = run_cli(["eval", *common(assets), "--eval-prompt-data", "t",
                                 str(assets / "data" / "test.parquet"), "--eval-function-path",
                                 "tests.rewards_for_miles_flags.eval_two_sets", "--output-dir", str(out)], capsys)
    assert code == 0, err
    m = json.loads(stdout.strip().splitlines()[-1])
    assert m["eval/fixed"] == 0.25          # its own rewards
    assert m["eval/t"] == 1.0               # rewarded by the set's reward: index 0 samples score 1
    code, _, err = run_cli(["eval", *common(assets), "--eval-prompt-data", "t", str(assets / "data" / "test.parquet"),
                            "--eval-function-path", "tests.rewards_for_miles_flags.nope", "--output-dir",
                            str(tmp_path / "g")], capsys)
    assert code == 2
    one_line(err, "--eval-function-path")


def test_eval_config_references_through_eval(assets, tmp_path, capsys):
    # miles reads --eval-config with OmegaConf: ${...} names other keys of the file
    (tmp_path / "e.yaml").write_text(f"""
data: {assets / "data"}
eval:
  defaults: {{n_samples_per_eval_prompt: 3}}
  datasets:
    - {{name: test, path: "${{data}}/${{.name}}.parquet", n_samples_per_eval_prompt: "${{eval.defaults.n_samples_per_eval_prompt}}"}}
    - {{name: again, path: "${{..0.path}}", max_response_len: 2}}
""")
    out = tmp_path / "o"
    code, _, err = run_cli(["eval", *common(assets), "--eval-config", str(tmp_path / "e.yaml"), "--output-dir", str(out)],
                           capsys)
    assert code == 0, err
    assert len((out / "samples" / "eval_test_0.jsonl").read_text().splitlines()) == 2 * 3
    # its path is the first set's, resolved where that one stands (${.name} is "test" there)
    assert len((out / "samples" / "eval_again_0.jsonl").read_text().splitlines()) == 2 * 3
    (tmp_path / "bad.yaml").write_text("eval: {datasets: [{name: a, path: '${root}/a.jsonl'}]}")
    code, _, err = run_cli(["eval", *common(assets), "--eval-config", str(tmp_path / "bad.yaml"),
                            "--output-dir", str(tmp_path / "b")], capsys)
    assert code == 2
    one_line(err, "--eval-config", "eval.datasets[0].path", "no key root")
