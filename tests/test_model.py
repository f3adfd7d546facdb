"""furlong.models against transformers on tiny random checkpoints, and its own fast paths
against the obvious slow ones (packed vs per-sample, padded vs unpadded); config parsing,
load errors and save_hf. Scaled RoPE: test_model_rope.py; the packed attention op on its
own: test_model_attention.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from furlong.models import ModelArgs, Transformer, hf_state_dict, load_pretrained, save_hf
from tiny_checkpoints import TOKENIZER_SIZE, write_tiny_checkpoint

VOCAB = 128
TOL = 1e-4

# (id, family, tie, num_shards, attention_bias, kv_heads)
CASES = [
    ("llama-untied", "llama", False, 1, False, 4),
    ("llama-tied-bias-sharded", "llama", True, 2, True, 2),
    ("qwen2-untied", "qwen2", False, 1, False, 2),
    ("qwen2-tied-sharded", "qwen2", True, 3, False, 1),
    ("qwen3-tied", "qwen3", True, 1, False, 2),
    ("qwen3-untied-bias-sharded", "qwen3", False, 3, True, 2),
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {cid: write_tiny_checkpoint(root / cid, family=fam, vocab_size=VOCAB, tie=tie, num_shards=shards,
                                       attention_bias=bias, kv_heads=kv, seed=i)
            for i, (cid, fam, tie, shards, bias, kv) in enumerate(CASES)}


def _hf_logits(path, ids, **kw):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids, **kw).logits


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_logits_match_transformers(ckpts, cid):
    path = ckpts[cid]
    if "sharded" in cid:
        assert (path / "model.safetensors.index.json").is_file()
        assert not (path / "model.safetensors").exists()
    model = load_pretrained(path)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert (model.lm_head is None) == model.args.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    ref = _hf_logits(path, ids)
    assert ours.shape == (2, 17, VOCAB)
    assert (ours - ref).abs().max().item() <= TOL


def test_family_switches_parsed(ckpts):
    qwen2 = ModelArgs.from_dir(ckpts["qwen2-untied"])
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelArgs.from_dir(ckpts["qwen3-untied-bias-sharded"])
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (True, True, True)
    llama = ModelArgs.from_dir(ckpts["llama-untied"])
    assert (llama.qkv_bias, llama.qk_norm, llama.num_kv_heads) == (False, False, 4)
    assert qwen3.eos_token_ids == [2] and qwen3.head_dim == 16


def test_transformers4_style_config():
    cfg = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 48, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
           "rope_theta": 1e6, "rope_scaling": None, "torch_dtype": "bfloat16", "eos_token_id": [5, 7]}
    args = ModelArgs.from_hf_config(cfg)
    assert args.head_dim == 8 and args.rope_theta == 1e6 and args.torch_dtype == torch.bfloat16
    assert args.eos_token_ids == [5, 7] and not args.tie_word_embeddings


@pytest.mark.parametrize("bad, key", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7}},
     "rope_scaling.mscale"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 32}}, "rope_scaling.beta_fast"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}}, "rope_scaling.high_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_errors_name_key(ckpts, tmp_path, bad, key):
    cfg = json.loads((ckpts["qwen3-tied"] / "config.json").read_text())
    cfg.update(bad)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json.*{key}"):
        ModelArgs.from_dir(tmp_path)


def _packed_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return samples, torch.cat(samples), pos, cu


@pytest.mark.parametrize("cid", ["qwen3-tied", "llama-untied", "qwen2-untied"])
def test_packed_equals_per_sample(ckpts, cid):
    model = load_pretrained(ckpts[cid])
    lengths = [5, 11, 1, 8]
    samples, ids, pos, cu = _packed_batch(lengths)
    with torch.no_grad():
        hidden = model.forward_packed(ids, pos, cu, max(lengths))
        packed_logits = hidden @ model.output_weight.T
        ref = torch.cat([model(s[None])[0] for s in samples])
    assert hidden.shape == (sum(lengths), model.args.hidden_size)
    assert (packed_logits - ref).abs().max().item() <= 1e-5


def test_packed_grads_with_and_without_checkpointing(ckpts):
    model = load_pretrained(ckpts["qwen3-untied-bias-sharded"]).train()
    _, ids, pos, cu = _packed_batch([4, 9, 6], seed=3)

    def grads(ckpt: bool):
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing = ckpt
        hidden = model.forward_packed(ids, pos, cu, 9)
        logp = torch.log_softmax(hidden @ model.output_weight.T, -1)
        logp[:-1].gather(1, ids[1:, None]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    assert set(plain) == set(ckpt) and all(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6)


def test_empty_packed_row(ckpts):
    model = load_pretrained(ckpts["qwen3-tied"])
    empty = torch.zeros(0, dtype=torch.long)
    out = model.forward_packed(empty, empty, torch.zeros(1, dtype=torch.int32), 0)
    assert out.shape == (0, model.args.hidden_size)


def test_left_padded_batch_equals_unpadded_rows(ckpts):
    model = load_pretrained(ckpts["llama-tied-bias-sharded"])
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 4, 1)]
    t = 9
    ids = torch.zeros(3, t, dtype=torch.long)
    mask = torch.zeros(3, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):], mask[i, t - len(r):] = r, 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        hf = _hf_logits(ckpts["llama-tied-bias-sharded"], ids, attention_mask=mask)
        assert torch.isfinite(padded).all()
        for i, r in enumerate(rows):
            alone = model(r[None])[0]
            assert (padded[i, t - len(r):] - alone).abs().max().item() <= 1e-5
            assert (hf[i, t - len(r):] - alone).abs().max().item() <= TOL


def test_hidden_states_and_output_weight(ckpts):
    model = load_pretrained(ckpts["qwen3-untied-bias-sharded"])
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids) @ model.output_weight.T, model(ids))
    assert model.output_weight is model.lm_head.weight
    tied = load_pretrained(ckpts["qwen3-tied"])
    assert tied.output_weight is tied.embed_tokens.weight


def test_dtype_cast_keeps_fp32_rope(ckpts):
    model = load_pretrained(ckpts["qwen3-tied"], dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    ref = Transformer(model.args).inv_freq
    torch.testing.assert_close(model.inv_freq, ref, rtol=0, atol=0)
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (1, 5)))
    assert out.dtype == torch.bfloat16


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(tmp_path)


def test_missing_safetensors(ckpts, tmp_path):
    shutil.copy(ckpts["qwen3-tied"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_missing_shard_file(ckpts, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(ckpts["qwen2-tied-sharded"], dst)
    shard = sorted(set(json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (dst / shard).unlink()
    with pytest.raises(ValueError, match=shard.replace(".", r"\.")):
        load_pretrained(dst)


def test_missing_tensor_key(ckpts, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(ckpts["qwen3-tied"], dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_pretrained(dst)


def test_shape_mismatch_and_unexpected_key(ckpts, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(ckpts["qwen3-tied"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.(gate|up|down)_proj\.weight"):
        load_pretrained(dst)
    cfg["intermediate_size"] = 128
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_pretrained(dst)


@pytest.mark.parametrize("cid", ["qwen3-tied", "qwen2-untied", "llama-tied-bias-sharded"])
def test_save_hf_round_trip(ckpts, tmp_path, cid):
    from transformers import AutoTokenizer
    src = ckpts[cid]
    model = load_pretrained(src)
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("not the checkpoint's: kept")
    save_hf(model, model.args, out, tokenizer_src=src)
    assert (out / "notes.txt").read_text() == "not the checkpoint's: kept"   # only its own files are replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp dirs left
    saved = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in saved) == (not model.args.tie_word_embeddings)
    assert set(saved) == set(hf_state_dict(model.state_dict()))
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        ours = model(ids)
    assert torch.equal(_hf_logits(out, ids), _hf_logits(src, ids))
    assert (_hf_logits(out, ids) - ours).abs().max().item() <= TOL
    with torch.no_grad():
        assert torch.equal(load_pretrained(out)(ids), ours)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == TOKENIZER_SIZE and tok.eos_token == "<|im_end|>" and tok.chat_template
    assert (out / "generation_config.json").is_file()


def test_hf_state_dict_rejects_wrapped_names():
    with pytest.raises(ValueError, match="_orig_mod.embed_tokens.weight"):
        hf_state_dict({"_orig_mod.embed_tokens.weight": torch.zeros(1)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_model_bf16_cuda_matches_rows_and_backprops(ckpts):
    model = load_pretrained(ckpts["qwen3-untied-bias-sharded"], dtype=torch.bfloat16, device="cuda").train()
    lengths = [13, 1, 40, 7]
    samples, ids, pos, cu = _packed_batch(lengths, seed=5)
    hidden = model.forward_packed(ids.cuda(), pos.cuda(), cu.cuda(), max(lengths))
    with torch.no_grad():
        rows = torch.cat([model.hidden_states(s[None].cuda())[0] for s in samples])
    assert (hidden.float() - rows.float()).abs().max().item() < 5e-2
    (hidden.float() @ model.output_weight.float().T).logsumexp(-1).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
