"""Multi-turn KV reuse with an fp8 KV cache (kv_dtype "fp8_e4m3").

Why reuse is not token-exact against a full re-prefill with fp8: a prefill attends over its own
tokens' unquantised K/V, and only later reads see the stored fp8 (kv_fp8.py). A re-prefill of the
whole conversation therefore attends over the unquantised K/V of every earlier turn, and computes
the earlier turns' hidden states (so their K/V at every layer past the first) with unquantised
attention, where the reused cache holds fp8 K/V whose hidden states were computed from decode steps
that read fp8. The two differ by the fp8 error, so a greedy token can flip wherever its two best
logits are closer than that: it is the same gap as between the fp8 and the unquantised engine.

What reuse must compute exactly is the fp8 engine's own arithmetic had it kept going: each prefill
(a prompt, or a continuation's new tokens) attends over its own tokens unquantised and over every
earlier token as stored in fp8; each decode step reads everything, itself included, as stored. The
reference below writes that out over the engine's forward with a plain list of (quantised, then
dequantised) K/V per layer; reused conversations, interleaved and sharing prefills with a fresh
prompt, must give its greedy tokens exactly. The second test bounds the gap to the re-prefill.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.kv_fp8 import dequantize, quantize
from furlong.models.hf_io import load_pretrained
from tiny_checkpoints import write_tiny_checkpoint

PROMPTS = [[5 + i] * (3 + 5 * i) for i in range(4)] + [list(range(30, 49))]   # 3 .. 19 tokens
TURNS = [(6, 5), (9, 8), (5, 0)]                          # (model tokens, then tool tokens) per turn
FRESH = list(range(60, 71))                               # a new prompt admitted beside the continuations


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # as test_kv_fp8.py: weights at init_std 0.05, a row long enough for the absmax scale
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3fp8mt"), family="qwen3", vocab_size=128, hidden=128,
                                 layers=2, heads=4, kv_heads=2, seed=4, init_std=0.05)
    return load_pretrained(path, dtype=torch.float32, device="cpu")


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return ""


def engine(model, kv_dtype="fp8_e4m3", **kw):
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=2048, max_model_len=256,
               kv_dtype=kv_dtype)
    cfg.update(kw)
    return Engine(model, _Tok(), [], EngineConfig(**cfg))


def tool_tokens(conv: int, turn: int, num: int) -> list[int]:
    return [10 + (conv * 7 + turn * 13 + j * 3) % 90 for j in range(num)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def run_engine(eng, reuse: bool):
    """All conversations' turns interleaved (each turn of every conversation in the engine at once), plus
    FRESH added with the second turn's continuations. Returns per conversation its turns' (tokens,
    log-probs) (FRESH last, as a one-turn conversation)."""
    convs, out, last = [list(p) for p in PROMPTS], [[] for _ in range(len(PROMPTS) + 1)], {}
    for t, (num_new, num_tool) in enumerate(TURNS):
        ids = {}
        for c, ctx in enumerate(convs):
            ids[rid := eng.new_request_id()] = c
            eng.add(Request(rid, list(ctx), greedy(num_new), retain_kv=reuse, continues=last.get(c) if reuse else None))
        if t == 1:
            ids[rid := eng.new_request_id()] = len(PROMPTS)
            eng.add(Request(rid, FRESH, greedy(num_new)))
        while eng.has_work():
            for comp in eng.step():
                c = ids[comp.request_id]
                out[c].append((comp.token_ids, comp.log_probs))
                if c < len(PROMPTS):
                    convs[c] += comp.token_ids + tool_tokens(c, t, num_tool)
                    last[c] = comp.request_id
    eng.free(set(last.values()))
    return out


class Fp8Reference:
    """One conversation through the engine's forward with its K/V kept as the fp8 cache returns them."""

    def __init__(self, forward, num_layers: int):
        self.forward = forward
        self.k: list[torch.Tensor | None] = [None] * num_layers     # [S, Hkv, D] stored (dequantised) keys
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.num_stored = 0

    def feed(self, tokens: list[int], own_unquantised: bool) -> torch.Tensor:
        """Run `tokens` at the next positions; returns the last one's logits [V]."""
        start = self.num_stored
        stored = lambda x: dequantize(*quantize(x), x.dtype)   # noqa: E731  what a later read sees

        def attend(layer, q, k, v):
            own_k, own_v = (k, v) if own_unquantised else (stored(k), stored(v))
            keys = own_k if self.k[layer] is None else torch.cat([self.k[layer], own_k])
            vals = own_v if self.v[layer] is None else torch.cat([self.v[layer], own_v])
            n, m = q.shape[0], keys.shape[0]
            mask = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]     # query j sees keys <= start + j
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                               attn_mask=mask, enable_gqa=True)
            self.k[layer] = torch.cat([keys[:start], stored(k)])
            self.v[layer] = torch.cat([vals[:start], stored(v)])
            return o.transpose(0, 1)

        ids = torch.tensor(tokens)
        hidden = self.forward.hidden(ids, torch.arange(start, start + len(tokens)), attend)
        self.num_stored += len(tokens)
        return self.forward.logits(hidden[-1:])[0]

    def turn(self, context: list[int], num_new: int) -> tuple[list[int], list[float]]:
        """Greedy: prefill what is not stored yet (the engine's reusable prefix is every fed token), then
        decode; the tokens and their log-probs."""
        toks, lps = [], []
        logits = self.feed(context[self.num_stored:], own_unquantised=True)
        while True:
            toks.append(int(logits.argmax()))
            lps.append(float(torch.log_softmax(logits.float(), -1)[toks[-1]]))
            if len(toks) == num_new:
                return toks, lps
            logits = self.feed(toks[-1:], own_unquantised=False)


@torch.no_grad()
def test_fp8_reuse_equals_the_fp8_engines_own_arithmetic(model):
    eng = engine(model)
    got = run_engine(eng, reuse=True)
    assert eng.scheduler.blocks.num_used == 0 and eng.stats.num_cached_tokens > 0
    forward, num_layers = eng.runner.forward, len(eng.runner.forward.layers)
    for c, prompt in enumerate(PROMPTS):
        ref, ctx, want = Fp8Reference(forward, num_layers), list(prompt), []
        for t, (num_new, num_tool) in enumerate(TURNS):
            want.append(ref.turn(ctx, num_new))
            ctx += want[-1][0] + tool_tokens(c, t, num_tool)
        same(got[c], want, f"conversation {c}")
    same(got[-1], [Fp8Reference(forward, num_layers).turn(FRESH, TURNS[1][0])], "the fresh prompt")


def same(got, want, what: str) -> None:
    """Equal tokens; log-probs to float32 summation order (quantising a prefill's own K/V moves them ~1e-2)."""
    assert [t for t, _ in got] == [t for t, _ in want], what
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb))
    print(f"{what}: max |log-prob - reference| {diff:.2e}")
    assert diff < 1e-5, what


@torch.no_grad()
def test_fp8_reuse_is_as_close_to_the_model_as_an_fp8_reprefill(model):
    """Both fp8 runs re-scored by the unquantised model, teacher-forced over each whole conversation
    (no divergence compounds): reuse adds no error beyond fp8's own. First turns are one computation."""
    reuse, reprefill = run_engine(engine(model), reuse=True), run_engine(engine(model), reuse=False)
    gaps = {}
    for name, runs in (("reuse", reuse), ("re-prefill", reprefill)):
        gap = []
        for c, prompt in enumerate(PROMPTS):
            ctx, model_turns = list(prompt), []
            for t, ((_, num_tool), (toks, _)) in enumerate(zip(TURNS, runs[c])):
                model_turns.append((len(ctx), toks))
                ctx += toks + tool_tokens(c, t, num_tool)
            logp = torch.log_softmax(model(torch.tensor([ctx]))[0].double(), -1)
            for at, toks in model_turns:      # the model's greedy margin at each of the run's tokens
                rows = logp[at - 1:at - 1 + len(toks)]
                gap.append(rows.max(-1).values - rows.gather(-1, torch.tensor(toks)[:, None])[:, 0])
        gaps[name] = torch.cat(gap)
    assert [r[0][0] for r in reuse] == [r[0][0] for r in reprefill]
    print({k: f"mean {g.mean():.5f} max {g.max():.5f}" for k, g in gaps.items()})
    assert gaps["reuse"].mean() < 0.03 and gaps["reuse"].mean() <= 2 * gaps["re-prefill"].mean() + 0.005
