"""LoRA (models/lora.py, lora_names.py, lora_export.py) against peft on tiny checkpoints of each family.

With the same adapter weights, furlong's adapted decoder and `peft.get_peft_model` on the
transformers model of the same checkpoint give the same logits and the same adapter gradients;
adapters off = the base model; the merged weights = base + adapters; the exported peft folder
loads with `PeftModel.from_pretrained` and gives the same logits, and so does the merged HF
checkpoint with transformers.
"""
from __future__ import annotations

import json

import pytest
import torch

from furlong.models import load_pretrained
from furlong.models.hf_config import ModelArgs
from furlong.models.lora import (LoraConfig, adapter_state_dict, adapters_disabled, apply_lora, lora_modules,
                                 merged_state_dict)
from furlong.models.lora_export import save_merged_hf, save_peft_adapter
from furlong.models.lora_names import (hf_module_name, our_adapter_name, parse_target_modules, peft_key,
                                       resolve_targets)
from tiny_checkpoints import write_tiny_checkpoint

peft = pytest.importorskip("peft")

VOCAB = 128
TOL = 1e-4
# (id, family, tie, attention_bias)
CASES = [("llama", "llama", False, True), ("qwen2", "qwen2", True, False), ("qwen3", "qwen3", False, False)]
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpts")
    return {cid: write_tiny_checkpoint(root / cid, family=fam, vocab_size=VOCAB, hidden=32, layers=2, heads=4,
                                       kv_heads=2, tie=tie, attention_bias=bias, seed=i, with_tokenizer=False)
            for i, (cid, fam, tie, bias) in enumerate(CASES)}


def _spec(targets: str = "all-linear", seed: int = 0, dropout: float = 0.0) -> LoraConfig:
    return LoraConfig(rank=RANK, alpha=ALPHA, dropout=dropout, target_modules=parse_target_modules(targets), seed=seed)


def _adapted(path, targets: str = "all-linear", seed: int = 0):
    """furlong's model with adapters on `targets`, B made non-zero (seeded) so the adapters matter."""
    model = load_pretrained(path)
    spec = _spec(targets, seed)
    apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return model, spec


def _peft_model(path, model, targets: str = "all-linear"):
    """peft on the transformers model of `path`, loaded with `model`'s adapters through peft's own keys."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    t = parse_target_modules(targets)
    cfg = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                         target_modules="all-linear" if t == ("all-linear",) else list(t))
    pm = get_peft_model(hf, cfg)
    res = set_peft_model_state_dict(pm, {peft_key(n): p.detach().clone() for n, p in adapter_state_dict(model).items()})
    assert not [k for k in res.unexpected_keys if "lora" in k]
    return pm


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(seed))


def _peft_adapted_modules(pm) -> list[str]:
    from peft.tuners.lora import LoraLayer
    return sorted(n[len("base_model.model."):] for n, m in pm.named_modules() if isinstance(m, LoraLayer))


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                     "q_proj, v_proj,down_proj"])
def test_forward_and_adapter_grads_match_peft(ckpts, cid, targets):
    model, _ = _adapted(ckpts[cid], targets)
    pm = _peft_model(ckpts[cid], model, targets)
    # the same modules carry adapters (peft's all-linear leaves out the LM head, tied or not)
    assert sorted(hf_module_name(n) for n in lora_modules(model)) == _peft_adapted_modules(pm)
    ids = _ids()
    w = torch.randn(2, 13, VOCAB, generator=torch.Generator().manual_seed(2))
    ours = model(ids)
    ref = pm(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= TOL
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    theirs = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert len(theirs) == len(adapter_state_dict(model))
    for n, p in adapter_state_dict(model).items():
        g = theirs[peft_key(n).replace(".weight", ".default.weight")].grad
        scale = g.abs().max().item()
        assert scale > 0, n
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * scale, msg=n)


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_only_adapters_train_and_start_as_the_base(ckpts, cid):
    base = load_pretrained(ckpts[cid])
    model = load_pretrained(ckpts[cid])
    spec = _spec()
    names = apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    assert len(names) == 7 * 2
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(adapter_state_dict(model))
    for m in lora_modules(model).values():
        assert m.lora_A.dtype == m.lora_B.dtype == torch.float32
        assert m.lora_B.abs().max() == 0
        bound = 1 / m.in_features ** 0.5   # kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
        assert 0.5 * bound < m.lora_A.abs().max() <= bound
    # base parameter names unchanged (HF I/O, weight sync and checkpoints see the plain decoder)
    assert set(merged_state_dict(model)) == set(base.state_dict())
    with torch.no_grad():
        assert torch.equal(model(_ids()), base(_ids()))


def test_adapter_init_is_seeded(ckpts):
    a, _ = _adapted(ckpts["qwen3"], seed=3)
    b, _ = _adapted(ckpts["qwen3"], seed=3)
    c, _ = _adapted(ckpts["qwen3"], seed=4)
    for n, p in adapter_state_dict(a).items():
        assert torch.equal(p, adapter_state_dict(b)[n])
    assert not torch.equal(a.layers[0].self_attn.q_proj.lora_A, c.layers[0].self_attn.q_proj.lora_A)


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_disabled_is_base_and_merged_is_adapted(ckpts, cid):
    model, _ = _adapted(ckpts[cid])
    base = load_pretrained(ckpts[cid])
    ids = _ids(5)
    with torch.no_grad():
        adapted = model(ids)
        with adapters_disabled(model):
            off = model(ids)
        again = model(ids)
        merged = load_pretrained(ckpts[cid])
        merged.load_state_dict(merged_state_dict(model))
        assert (adapted - base(ids)).abs().max() > 1e-2     # the adapters change the model
        assert torch.equal(off, base(ids))
        assert torch.equal(again, adapted)                  # the switch is restored
        assert (merged(ids) - adapted).abs().max().item() <= TOL


def test_dropout_only_in_training_with_grad(ckpts):
    model = load_pretrained(ckpts["qwen3"])
    spec = _spec(dropout=0.5)
    apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B, std=0.1)
    ids = _ids()
    model.eval()
    with torch.no_grad():
        ref = model(ids)
    model.train()
    with torch.no_grad():
        assert torch.equal(model(ids), ref)            # the trainer's log-prob passes: deterministic
    assert (model(ids) - ref).abs().max() > 1e-3       # a training forward drops adapter inputs


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_peft_folder_loads_with_peft_and_merged_checkpoint_with_transformers(ckpts, cid, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model, spec = _adapted(ckpts[cid], "q_proj,v_proj,up_proj")
    ids = _ids(7)
    with torch.no_grad():
        ours = model(ids)
    out = save_peft_adapter(model, spec, tmp_path / "adapter", base_model=str(ckpts[cid]))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "up_proj", "v_proj"] and cfg["r"] == RANK
    hf = AutoModelForCausalLM.from_pretrained(ckpts[cid], attn_implementation="eager", dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        assert (pm(input_ids=ids).logits - ours).abs().max().item() <= TOL
    merged_dir = save_merged_hf(model, ModelArgs.from_dir(ckpts[cid]), tmp_path / "merged")
    hf_merged = AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        assert (hf_merged(ids).logits - ours).abs().max().item() <= TOL


def test_subset_of_layers_exports_full_module_names(ckpts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model, spec = _adapted(ckpts["qwen3"], "layers.1.mlp.down_proj")
    assert list(lora_modules(model)) == ["layers.1.mlp.down_proj"]
    out = save_peft_adapter(model, spec, tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["model.layers.1.mlp.down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(ckpts["qwen3"], attn_implementation="eager", dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, str(out)).eval()
    ids = _ids(8)
    with torch.no_grad():
        assert (pm(input_ids=ids).logits - model(ids)).abs().max().item() <= TOL


def test_names_round_trip():
    name = "layers.3.self_attn.q_proj.lora_A"
    assert peft_key(name) == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert our_adapter_name(peft_key(name)) == name
    for bad in ("base_model.model.lm_head.lora_A.weight", "model.layers.0.mlp.up_proj.weight",
                "base_model.model.model.layers.0.mlp.up_proj.lora_C.weight"):
        with pytest.raises(ValueError):
            our_adapter_name(bad)


@pytest.mark.parametrize("flag,msg", [("foo_proj", "--target-modules: 'foo_proj' matches no"),
                                      ("lm_head", "--target-modules: 'lm_head' matches no"),
                                      ("q_proj,,v_proj", "--target-modules: expected"),
                                      ("", "--target-modules: expected")])
def test_bad_targets_name_the_flag(ckpts, flag, msg):
    model = load_pretrained(ckpts["llama"])
    with pytest.raises(ValueError, match=msg):
        resolve_targets(model, parse_target_modules(flag))


def test_apply_twice_or_rank_zero_refused(ckpts):
    model, spec = _adapted(ckpts["qwen3"])
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, spec, ["layers.0.mlp.up_proj"])
    fresh = load_pretrained(ckpts["qwen3"])
    with pytest.raises(ValueError, match="--lora-rank"):
        apply_lora(fresh, LoraConfig(0, 8.0, 0.0, ("all-linear",), 0), ["layers.0.mlp.up_proj"])
