"""The decode kernel's split count (furlong/engine/splits.py): the wave rule's choices, the program
rule the engine uses, and (CUDA) the resident-program counts against the compiled kernels."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.engine.splits import (SPLIT_COUNTS, program_splits, programs_per_sm, resident_programs, wave_cost,
                                   wave_splits)

SLOTS = 132 * 8          # an H100/H200's multiprocessors x the fp8 kernel's resident programs
ROOT = Path(__file__).resolve().parents[1]


def test_a_second_nearly_empty_wave_is_split_away():
    # 140 rows x 8 KV heads = 1,120 programs: two waves at one split, the second 6% full
    assert wave_cost(140, 64, 1, 8, SLOTS) == 2 * 65
    s = wave_splits(140, 4096, 64, 8, SLOTS)
    assert s > 1 and wave_cost(140, 64, s, 8, SLOTS) < 0.75 * wave_cost(140, 64, 1, 8, SLOTS)


def test_full_waves_keep_one_split():
    # exactly two full waves (264 rows) or one (132): splitting only adds programs' fixed costs
    assert wave_splits(264, 8192, 64, 4, 132 * 8) == 1
    assert wave_splits(132, 4096, 64, 8, SLOTS) == 1


def test_short_contexts_and_single_tiles():
    assert wave_splits(1, 10, 64, 8, SLOTS) == 1                # one tile: nothing to split
    assert wave_splits(0, 1000, 64, 8, SLOTS) >= 1              # no rows: still a valid count
    s = wave_splits(3, 640, 64, 8, SLOTS)                       # 10 tiles: never more splits than tiles
    assert 1 < s <= 10 and s in SPLIT_COUNTS


def test_few_long_rows_split_many_ways():
    # 8 rows of 8,192 tokens: 64 programs on 1,056 slots; the largest counts cut a program's tiles most
    assert wave_splits(8, 8192, 64, 8, SLOTS) == max(SPLIT_COUNTS)


def test_program_rule_as_before():
    assert [program_splits(r, 8, 132) for r in (1, 8, 32, 64, 66, 67, 256)] == [16, 16, 4, 2, 1, 1, 1]
    assert program_splits(3, 8, 132, cap=4) == 4


def test_model_runner_dispatches_each_rule(tmp_path):
    """ModelRunner.num_splits on a (pretended) GPU: the program rule counts the bucket's padded rows, the
    wave rule the real rows, the longest context and the kernel variant's slots; the CPU always 1."""
    from furlong.engine import Engine, EngineConfig
    from furlong.models.hf_io import load_pretrained
    from tiny_checkpoints import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=128, hidden=64, layers=2, heads=4,
                                 kv_heads=2, seed=0)
    runner = Engine(load_pretrained(path, dtype=torch.float32, device="cpu"), None, [],
                    EngineConfig(page_size=64, cpu_kv_tokens=1024, kv_dtype="fp8_e4m3")).runner
    assert runner.split_rule == "programs" and runner.num_splits(3, 4, 5000, False) == 1      # the CPU
    runner.on_gpu, runner.num_sms = True, 132
    assert runner.num_splits(70, 80, 4096, False) == program_splits(80, 2, 132) == 4
    runner.split_rule = "waves"
    # 2 KV heads here: 70 real rows pick 8 on the transposed fp8 kernel's 1,188 slots (its cascade row
    # programs too, "transposed-all"), 6 on the padded one's 1,056, 3 on the padded cascade kernel's
    # 528, and 60 real rows in the same bucket 8: each input reaches the rule
    assert runner.fp8_kernel == "transposed-all"                        # the engine's default
    assert runner.num_splits(70, 80, 4096, False) == wave_splits(70, 4096, 64, 2, 132 * 9) == 8
    assert runner.num_splits(70, 80, 4096, True) == 8
    runner.fp8_kernel = "transposed"                                    # cascade launches: the padded kernel
    assert runner.num_splits(70, 80, 4096, False) == 8
    assert runner.num_splits(70, 80, 4096, True) == wave_splits(70, 4096, 64, 2, 132 * 4) == 3
    runner.fp8_kernel = "padded"
    assert runner.num_splits(70, 80, 4096, False) == wave_splits(70, 4096, 64, 2, 132 * 8) == 6
    assert runner.num_splits(60, 80, 4096, False) == 8


def test_resident_programs_by_kernel_variant():
    assert resident_programs(fp8=True, cascade=False, transposed=True) == 9
    assert resident_programs(fp8=True, cascade=False, transposed=False) == 8
    assert resident_programs(fp8=True, cascade=True, transposed=True) == 9        # "transposed-all": its own launch
    assert resident_programs(fp8=True, cascade=True, transposed=False) == 4
    assert all(resident_programs(fp8=False, cascade=c, transposed=t) == 4 for c in (0, 1) for t in (0, 1))
    assert programs_per_sm(207, 1, 19968) == resident_programs(fp8=True, cascade=True, transposed=True)   # offline
    # the counts follow from the sm_90 compiles splits.py cites (registers, warps, shared bytes)
    assert programs_per_sm(205, 1, 19968) == resident_programs(fp8=True, cascade=False, transposed=True)
    assert programs_per_sm(255, 1, 20992) == resident_programs(fp8=True, cascade=False, transposed=False)
    assert programs_per_sm(202, 2, 23040) == resident_programs(fp8=True, cascade=True, transposed=False)
    assert programs_per_sm(115, 4, 38912) == resident_programs(fp8=False, cascade=False, transposed=False)
    assert programs_per_sm(32, 1, 0) == 32 and programs_per_sm(64, 4, 100_000) == 2    # block and smem caps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8,cascade,transposed", [(True, False, True), (True, False, False), (True, True, False),
                                                   (True, True, True), (False, False, False)])
def test_resident_programs_match_the_compiled_kernel(fp8, cascade, transposed):
    """The counts splits.py states, from the registers and shared memory of the kernel as compiled
    here: a Triton or driver change that moves the occupancy fails this rather than slowing decode."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    from decode_kernel_sweep import build
    from furlong.engine.cascade import PrefixGroups
    from furlong.engine.kernels import _decode_attn_kernel, paged_decode_attention
    from furlong.engine.kernels_transposed import _decode_attn_transposed_kernel
    fn = _decode_attn_transposed_kernel if transposed else _decode_attn_kernel
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        pytest.skip(f"the counts are sm_90's, this GPU is sm_{cap[0]}{cap[1]}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, ks, vs, tables, lens, _ = build(16, 256, fp8, g)
    prefix = None
    if cascade:
        z = torch.zeros(16, dtype=torch.int32, device="cuda")
        prefix = PrefixGroups(z, torch.full((16, 8), -1, dtype=torch.int32, device="cuda"), z)
    fn.device_caches.clear()
    paged_decode_attention(q, k, v, tables, lens, 2, prefix=prefix, key_scales=ks if fp8 else None,
                           value_scales=vs if fp8 else None, transposed=transposed)
    torch.cuda.synchronize()
    (kernel,) = [x for cache in fn.device_caches.values() for x in cache[0].values()]
    kernel._init_handles()
    smem = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_multiprocessor", 233472)   # sm_90: 228 KB
    assert programs_per_sm(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared,
                           smem) == resident_programs(fp8, cascade, transposed)
