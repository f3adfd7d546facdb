"""miles' flags in furlong: the committed docs/miles_flags.md is current, every miles flag gets exactly
one answer, and a refused one stops `furlong train` with its one line and exit 2 (in-process)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from furlong.cli import main
from furlong.miles_flag_names import MILES_FLAGS
from furlong.miles_flags import REFUSALS, UNSUPPORTED, answer, furlong_flags, refusal_line, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "miles_flags.md"


def test_committed_doc_is_generated_output():
    assert DOC.read_text() == render(), "run: python -m furlong.miles_flags > docs/miles_flags.md"


def test_every_miles_flag_classified_exactly_once():
    names = [n for group in MILES_FLAGS.values() for n in group]
    assert len(names) > 400
    assert not [n for n, c in Counter(names).items() if c > 1], "a flag in two miles groups"
    assert all(n.startswith("--") for n in names)
    table = render().splitlines()
    for n in names:
        rows = [line for line in table if line.startswith(f"| `{n}` |")]
        assert len(rows) == 1, n
        assert answer(n, furlong_flags())[0] in rows[0]


def test_answers_follow_config():
    defined = furlong_flags()
    assert answer("--lr", defined) == ("accepted", "")
    assert answer("--sglang-mem-fraction-static", defined) == ("accepted", "alias of --rollout-kv-fraction")
    assert answer("--sglang-enable-metrics", defined)[0] == "accepted, ignored"
    assert answer("--tensor-model-parallel-size", defined)[1].startswith("Megatron model parallelism: ")
    assert answer("--sglang-router-ip", defined)[1].startswith("SGLang servers")
    assert answer("--num-gpus-per-node", defined)[0] == "refused"   # cluster group: Ray placement
    assert refusal_line("--num-gpus-per-node").startswith("--num-gpus-per-node is a miles flag for "
                                                          "Ray placement: ")
    assert answer("--use-mlflow", defined) == ("refused", UNSUPPORTED.reason)
    assert refusal_line("--lr") is None                      # furlong's own
    assert refusal_line("--rollout-batch-siz") is None       # not miles': the did-you-mean applies
    # a Megatron/SGLang family member miles' list does not name is still refused by prefix
    assert "Megatron model parallelism" in refusal_line("--pipeline-model-parallel-split-rank")
    assert "SGLang" in refusal_line("--sglang-some-future-server-flag")
    assert all(r.reason and r.category for r in REFUSALS)


@pytest.mark.parametrize("argv, category", [
    (["--tensor-model-parallel-size", "2"], "Megatron model parallelism"),
    (["--sglang-router-port=3000"], "SGLang servers and their router"),
    (["--use-mlflow"], "a feature furlong lacks"),
])
def test_cli_refuses_miles_flag_with_one_line(argv, category, capsys):
    code = main(["train", "--hf-checkpoint", "x", "--prompt-data", "y", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    name = argv[0].split("=")[0]
    assert err.startswith(f"furlong train: {name} is a miles flag for {category}: "), err


def test_cli_keeps_did_you_mean_for_other_flags(capsys):
    code = main(["train", "--hf-checkpoint", "x", "--prompt-data", "y", "--rollout-batch-siz", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "did you mean --rollout-batch-size?" in err and "miles flag" not in err
