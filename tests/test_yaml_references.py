"""--eval-config's `${...}` references (furlong/yaml_references.py), with OmegaConf's meaning (DOC's
expected values were checked once against OmegaConf 2.3's to_container(resolve=True), which miles
calls), and the forms it refuses in one line."""
from __future__ import annotations

import pytest
import yaml

from furlong.yaml_references import resolve_references

DOC = r"""
root: /data
n: 4
eval:
  defaults: {n_samples_per_eval_prompt: "${n}", temperature: 0.6}
  datasets:
    - {name: aime, path: "${root}/aime.jsonl", max_response_len: 8192}
    - name: gsm8k
      path: ${root}/${.name}.parquet
      max_response_len: ${eval.datasets.0.max_response_len}
      temperature: ${eval.datasets[0].max_response_len}
      top_k: ${..0.max_response_len}
      metadata_overrides: ${eval.defaults}
      stop: ['\${not_a_ref}', "${eval.defaults.temperature}"]
"""


def test_references_resolve_as_omegaconf():
    out = resolve_references(yaml.safe_load(DOC), "--eval-config")
    ev = out["eval"]
    assert ev["defaults"] == {"n_samples_per_eval_prompt": 4, "temperature": 0.6}   # whole value: keeps the int
    aime, gsm = ev["datasets"]
    assert aime["path"] == "/data/aime.jsonl"
    assert gsm["path"] == "/data/gsm8k.parquet"                         # a relative key beside it, in a string
    assert gsm["max_response_len"] == gsm["temperature"] == gsm["top_k"] == 8192   # index forms, and `..`
    assert gsm["metadata_overrides"] == {"n_samples_per_eval_prompt": 4, "temperature": 0.6}   # resolved copy
    assert gsm["stop"] == ["${not_a_ref}", 0.6]                         # an escape; a float kept as a float
    assert yaml.safe_load(DOC)["eval"]["datasets"][1]["path"] == "${root}/${.name}.parquet"   # input untouched


@pytest.mark.parametrize("doc,needle", [
    ("a: ${b}", "a: ${b}: the file has no key b"),
    ("a: {b: '${a.c.d}', c: {}}", "a.b: ${a.c.d}: the file has no key a.c.d"),
    ("l: [1, '${l.5}']", "l[1]: ${l.5}: the file has no key l.5"),
    ("a: ${b}\nb: x${a}", "references form a cycle"),
    ("a: ${a}", "references form a cycle (a -> a)"),
    ("a: ${oc.env:HOME}", "resolvers (oc.env, ...) are not supported"),
    ("a: ${b.${c}}\nc: d", "a nested or unclosed"),
    ("a: x${b}\nb: {c: 1}", "${b} is a dict, which cannot be part of the string"),
    ("a: ${...b}", "goes above the root"),
])
def test_bad_references_are_one_line(doc, needle):
    with pytest.raises(ValueError) as e:
        resolve_references(yaml.safe_load(doc), "--eval-config")
    assert str(e.value).startswith("--eval-config: ") and needle in str(e.value) and "\n" not in str(e.value)
