"""Mixed steps (scheduler.py, `mix_prefill`): work that arrives while rows decode is prefilled in the same
step as their window. The tokens are the ones separate prefill and decode steps give (greedy: a no-cache
loop's too), under staggered arrivals, multi-turn continuations and preemption; admission comes after
the running rows took their window's pages. GPU: the prefill is launched without a host sync, and a
mixed step equals its two halves run apart."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.block_manager import BlockManager
from furlong.engine.scheduler import Scheduler
from furlong.engine.sequence import StepOutput
from furlong.engine.stats import EngineStats
from furlong.engine.stop import StopRules
from furlong.models.hf_io import load_pretrained
from furlong.rollout.rollout_metrics import engine_metrics
from test_engine import reference_greedy
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3mix"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=2)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


def engine(ckpt, mix: bool, **kw):
    model, tok = ckpt
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=2048, max_model_len=256,
               cascade_min_prefix=1, mix_prefill=mix)
    cfg.update(kw)
    return Engine(model, tok, [], EngineConfig(**cfg))


def params(num_new: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=num_new, ignore_eos=True)


PROMPTS = [[3 + i] * (2 + 7 * i) for i in range(6)]     # 2 .. 37 tokens
NEWS = [30, 11, 25, 6, 19, 14]


def staggered(eng: Engine, temperature: float) -> dict[tuple[int, int], tuple[list[int], list[float]]]:
    """Request i is added after the engine ran 2 * i steps: every later one arrives while rows decode."""
    out, steps, nxt = {}, 0, 0
    while nxt < len(PROMPTS) or eng.has_work():
        while nxt < len(PROMPTS) and steps >= 2 * nxt:
            eng.add(Request(nxt, PROMPTS[nxt], params(NEWS[nxt], temperature), n=1 + nxt % 2, seed=nxt))
            nxt += 1
        for c in eng.step():
            out[(c.request_id, c.index)] = (c.token_ids, c.log_probs)
        steps += 1
    return out


def assert_no_cache_greedy(model, got: dict[tuple[int, int], tuple[list[int], list[float]]]) -> None:
    """Every sample of `staggered` (greedy) has a no-cache argmax loop's tokens."""
    for (rid, _), (tokens, _) in got.items():
        assert tokens == reference_greedy(model, PROMPTS[rid], NEWS[rid]), rid


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mixed_steps_sample_what_separate_steps_sample(ckpt, temperature):
    mixed, apart = engine(ckpt, mix=True), engine(ckpt, mix=False)
    got, want = staggered(mixed, temperature), staggered(apart, temperature)
    assert mixed.stats.num_mixed_steps > 0 and apart.stats.num_mixed_steps == 0
    assert mixed.stats.num_prefill_steps == apart.stats.num_prefill_steps    # the same admissions, just mixed
    logged = engine_metrics(mixed.stats)
    assert logged["perf/rollout_num_mixed_steps"] == mixed.stats.num_mixed_steps
    assert logged["perf/rollout_num_prefill_steps"] == mixed.stats.num_prefill_steps
    assert got.keys() == want.keys()
    for key in want:
        assert got[key][0] == want[key][0], key       # seeded per (sequence, position): batch-independent
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(want[key][1]), atol=1e-5, rtol=0)
    if temperature == 0:
        assert_no_cache_greedy(ckpt[0], got)
    assert mixed.scheduler.blocks.num_used == 0


def conversations(eng: Engine, num_turns: int) -> list[list[list[int]]]:
    """Each conversation's next turn is added the moment its previous one finishes (as the async front
    does), continuing its retained KV after a 5-token tool output."""
    turns: list[list[list[int]]] = [[] for _ in PROMPTS]
    ctx = [list(p) for p in PROMPTS]
    owner = {}
    for c in range(len(PROMPTS)):
        rid = eng.new_request_id()
        owner[rid] = c
        eng.add(Request(rid, ctx[c], params(NEWS[c] // 2 + 2, 0.0), retain_kv=True))
    while eng.has_work():
        for comp in eng.step():
            c = owner[comp.request_id]
            turns[c].append(comp.token_ids)
            ctx[c] = ctx[c] + comp.token_ids + [40 + c] * 5
            if len(turns[c]) < num_turns:
                rid = eng.new_request_id()
                owner[rid] = c
                eng.add(Request(rid, ctx[c], params(NEWS[c] // 2 + 2, 0.0), retain_kv=True,
                                continues=comp.request_id))
    return turns


@pytest.mark.parametrize("kw", [dict(), dict(cpu_kv_tokens=200, decode_window=2)])
def test_continuations_mixed_into_decode_windows(ckpt, kw):
    """cpu_kv_tokens=200: parked pages are evicted and waiting continuations' prefixes dropped (recomputed)
    while continuations are mixed in; the tokens stay the same."""
    mixed, apart = engine(ckpt, mix=True, **kw), engine(ckpt, mix=False, **kw)
    assert conversations(mixed, 3) == conversations(apart, 3)
    assert mixed.stats.num_mixed_steps > 0 and mixed.stats.num_cached_tokens > 0
    if "cpu_kv_tokens" in kw:
        roomy = engine(ckpt, mix=True)
        conversations(roomy, 3)
        assert mixed.stats.num_cached_tokens < roomy.stats.num_cached_tokens    # some prefixes were recomputed
    mixed.scheduler.retained.drop(set(mixed.scheduler.retained.parked))
    assert mixed.scheduler.blocks.num_used == 0


def test_mixed_greedy_with_preemption_equals_no_cache_loop(ckpt):
    eng = engine(ckpt, mix=True, cpu_kv_tokens=104, page_size=4, decode_window=2)
    got = staggered(eng, 0.0)
    assert eng.stats.num_preemptions > 0 and eng.stats.num_mixed_steps > 0
    assert_no_cache_greedy(ckpt[0], got)


def scheduler(num_pages: int) -> Scheduler:
    """Pages of 4 tokens (page 0 is the scratch page), windows of 4 tokens."""
    return Scheduler(BlockManager(num_pages, 4), max_num_seqs=4, max_prefill_tokens=64, window=4, max_model_len=64,
                     stop_rules=StopRules(None, frozenset()), stats=EngineStats())


@pytest.mark.parametrize("num_pages,admitted", [(6, True), (5, False)])
def test_admission_comes_after_the_running_rows_took_their_pages(num_pages, admitted):
    """A runs (5 tokens: its window needs a second page). B needs its prompt's page and a window's
    head-room (3 pages): it is mixed in only when those are left after A's growth, and never at the
    cost of preempting A."""
    s = scheduler(num_pages)
    s.add(Request(0, [5, 6, 7, 8], params(20, 0.0)))
    first = s.schedule()
    assert [len(i.token_ids) for i in first.prefill] == [4] and not first.decode
    s.postprocess(first, StepOutput([[9]], [[-1.0]]))
    s.add(Request(1, [1, 2, 3, 4], params(20, 0.0)))
    plan = s.schedule()
    a = s.running[0]
    assert plan.decode == [a] and len(a.block_table) == 2 and s.stats.num_preemptions == 0
    assert bool(plan.prefill) == admitted and len(s.waiting) == (0 if admitted else 1)
    out = StepOutput([[1, 2, 3, 4]] + [[11]] * admitted, [[-1.0] * 4] + [[-1.0]] * admitted)
    s.postprocess(plan, out)
    assert a.num_generated == 5 and len(s.running) == 1 + admitted
    assert s.stats.num_mixed_steps == admitted and s.stats.num_decode_steps == 4


@pytest.mark.parametrize("flags,mix", [([], True), (["--rollout-no-mix-prefill"], False)])
def test_the_flag_reaches_the_engine(flags, mix):
    from furlong.cli import parse_config
    from furlong.config_map import engine_config
    cfg = parse_config(["--hf-checkpoint", "c", "--prompt-data", "d", "--rm-type", "math", *flags])
    assert engine_config(cfg, max_model_len=64).mix_prefill is mix


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_mixed_step_on_gpu_is_sync_free_and_equals_its_halves():
    """The prefill half is launched while the window runs, with no host sync (sync debug mode raises on
    one); its tokens and the window's equal those of the same prefill and window run as two steps."""
    from test_engine_gpu import NullTok, small_model
    runs = []
    for mixed in (True, False):
        eng = Engine(small_model(torch.bfloat16), NullTok(), [],
                     EngineConfig(page_size=64, decode_window=8, max_num_seqs=8, max_model_len=512, kv_fraction=0.05))
        eng.add(Request(0, list(range(100, 190)), params(40, 0.0), n=2))
        eng.step()                                        # prefill alone: nothing runs yet
        eng.step()                                        # a window: graphs captured, buffers staged
        eng.add(Request(1, list(range(300, 370)), params(20, 1.0), n=3, seed=4))
        plan = eng.scheduler.schedule()
        assert plan.prefill and plan.decode
        runner = eng.runner
        if mixed:
            toks, _, _ = runner._launch_decode(plan.decode, plan.window)
            torch.cuda.set_sync_debug_mode("error")
            try:
                first = runner._launch_prefill(plan.prefill)[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            runs.append((toks[:, :len(plan.decode)].T.tolist(), first.tolist()))
        else:
            window = runner.decode(plan.decode, plan.window)
            runs.append((window.tokens, [t for (t,) in runner.prefill(plan.prefill).tokens]))
        eng.abort({0})              # request 1's sequences were taken from the queue and never started
        eng.release()
    assert runs[0] == runs[1]
