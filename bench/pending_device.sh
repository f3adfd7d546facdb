#!/usr/bin/env bash
# The device measurements still owed by the open issues, batched into device calls
# whose pieces' timeouts add up to <= 560 s, most important first (a session's 30 device minutes hold
# about three, fewer when starts fail).
# Run already (BENCHMARKS.md): on an H200 `either` (its h200 branch: 8B trains, 15.7 s a train step; the long
# rollout 51.4 s fp8 with the padded kernel, 75.5 s bf16) and call2's decode probe; on an H100 `transposed`
# (the transposed fp8 kernel: long rollout 60.9 -> 57.7 s and 62.9 -> 58.2 s on two machines),
# `cascade` (72.2 -> 64.1 s: "transposed-all" is the default), `levers` (no library, autotuner or
# kernel-setting lever for the decode step's fixed cost) and `rows`. Still owed, most important first:
# `overlap` (the step's rows as two halves on two streams: the one lever left that could take a large
# part of the fixed ~1.3 ms a step), `fixed` (inductor's PDL, a split-K matmul), `transposed` on an H200
# (issue 21's own card: against the padded kernel's 51.4 s), `rows` on an H200 (issue 20's table is the
# H200's), whether 8B fits an H100 (`h100`).
#   bash bench/pending_device.sh overlap|fixed|transposed|cascade|rows|levers|h100|call0|h200|either|call1|call2|call3
# overlap decode steps as two halves of the rows on two streams (engine/overlap.py, ModelRunner.overlap_min_rows;
#        off by default, never run on a GPU): its GPU test (graphs with the halves against a plain argmax
#        loop), the graphed fp8 decode step whole and as halves at the long rollout's bulk, middle and tail
#        shapes (bench/profile_decode.py --overlap-rows, alternating on the same rows), then the long fp8
#        rollout without and with it (>= 16 rows) on one engine. If it is faster, make it the default
#        (the threshold where the step shapes show it paying)
# fixed  two levers on the decode step's fixed cost (issue 21: ~1.24-1.34 ms a step over the long rollout's
#        8,191): the graphed fp8 decode step (bench/profile_decode.py, B x context in PDL_SHAPES) with
#        inductor's programmatic dependent launch off and on (TORCHINDUCTOR_ENABLE_PDL: the compiled
#        norm/RoPE/SiLU kernels may start while the kernel before them drains), a process each;
#        bench/skinny_linear.py's split-K matmul (its GPU test first) against cuBLAS at the decode shapes
#        on the time left
# call0  Qwen3-8B full-parameter with --optimizer-cpu-offload (issue 20: trains, step time), on an H200 only
#        (on an H100 the plan refuses it: 75 GiB of 72 usable from the 4096/8192 probes, and its 1024-token
#        probes ran out of memory, BENCHMARKS.md session 22), with the engine's weights released (the
#        default): the actor, its memory plan
#        and 3 train steps printed as each ends (bench/train_steps.py; the bench's train part outlasts a call
#        at this size), then the bench's train part on what time is left
# h200   on an H200, the two owed measurements that fit one call: call0's train steps, then call2's split
# h100   on an H100, call0's train steps with the caching allocator's expandable segments (the 1024-token
#        probes ran out of memory where larger ones ran: fragmentation suspected, BENCHMARKS.md session 22;
#        the engine is not built by bench/train_steps.py, so its CUDA graphs and arenas are not involved)
# either h200 on an H200, h100 on an H100 (for a call that may get either card)
# rows   issue 20's table rows not yet measured on an H200: Qwen3-1.7B full-parameter under the memory plan, and
#        LoRA (rank 64, all linear) at 0.6B, 1.7B and 4B (the seed step's shape, `furlong bench` train + rollout);
#        the LoRA rows' first train part compiles for ~60 s. ROWS="a b" picks some: by default the first three
#        (470 s), qwen3_4b_lora (200 s) in another call
# transposed  kernels_transposed.py's fp8 kernel (the engine's default; 875 SASS instructions a tile against
#        the padded kernel's 1,615): the fp8 GPU tests (its kernel against the dequantised reference, the
#        engine with it against the padded kernel), one layer beside the padded kernel at the long rollout's
#        shapes (bulk, mid, tail; 32- and 64-token tiles: 32 was slower for both on an H100), then the long
#        rollout with each on one engine (fitted split, by running rows; 64-token tiles)
# cascade the fp8 cache's cascade launches with their row programs in the transposed kernel ("transposed-all",
#        kv_cache.FP8_KERNELS; 842 SASS instructions a tile at 1 warp against the padded cascade kernel's
#        2 x 946, offline): its GPU tests (the kernel against the dequantised reference at 4 split pairs,
#        the engine against the padded kernel with groups), then the long rollout with prompts past the
#        cascade threshold (bench/long_prompt_workload.json) under the default and it, on one engine.
#        If it is faster, make it the default.
# levers issue 21's long rollout (<= 40 s) could take, measured before building either: the decode step's
#        matmuls as cuBLAS, cuBLASLt and inductor's autotuned Triton templates (static and dynamic M) at the
#        long rollout's running rows (bench/decode_gemm_sweep.py: are the ~0.45-0.6 ms a step they spend over
#        their floor a different kernel's to take?), then the fp8 decode kernel's warps x stages x V-load
#        order on this card at the rollout's shapes (bulk, mid and tail; the sweeps so far ran on an H100)
# call1  the engine's, the weight release's and the offloaded reference's GPU tests (63 passed on an H100, session 22)
# call2  the long rollout with fp8 and bf16 KV on one card (issue 21: <= 40 s; on an H200, the issue's own
#        card, these have not run since fp8's V became dim-major and its kernel 1-warp), each split into
#        fixed, per-row and attention costs (bench/rollout_time_split.py); the decode probe with both, the
#        residual adds folded into the matmuls (addmm) and kept pointwise (bf16 not yet measured that way)
# call3  the GPU demo, 100 rollouts: full-parameter bf16, --lora-rank 64 (issue 20), fp8 KV (issue 21);
#        VARIANTS="full fp8" picks some (all three can run past one call's 600 s: split them over two calls)
# Measured on an H100 and dropped from here: the mixed-step GPU test and multi-turn (1.20x), the long
# RL step with and without --partial-rollout (1.25x), the seed step, the decode kernel's launch settings
# and split rules (splits.py), the head-packed kernel (slower; dropped), the long train step's profile,
# the seed's RL step with the engine's weights kept vs released.
# Everything lands in $OUT (logs, JSON, plots); each piece is bounded by `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps_8b() {   # $1: seconds
    timeout -k 10 "$1" python3 bench/train_steps.py --workload bench/qwen3_8b_workload.json --optimizer-cpu-offload \
        --steps 3 >"$OUT/train_steps_8b.log" 2>&1; echo "== 8B train steps: exit $?"
    grep -E "memory plan|train_steps|Error" "$OUT/train_steps_8b.log" | tail -6
}
split_long() {   # $1: seconds
    timeout -k 10 "$1" python3 bench/rollout_time_split.py --workload bench/long_workload.json \
        --kv-dtype fp8_e4m3,bf16 --out "$OUT" >"$OUT/rollout_time_split.log" 2>&1
    echo "== rollout time split: exit $?"; grep -E "s = fixed|\(steady|warm-up rollout|Error" "$OUT/rollout_time_split.log"
}
case ${1:-} in
overlap)
    timeout -k 10 90 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging tests/test_engine_gpu.py \
        -k no_cache_loop_with_graphs >"$OUT/overlap_tests.log" 2>&1; echo "== overlap GPU test: exit $?"; tail -1 "$OUT/overlap_tests.log"
    for shape in ${OVERLAP_SHAPES:-256x2048 64x6144 16x8192}; do      # the long rollout's bulk, middle, tail
        timeout -k 10 ${OVERLAP_SHAPE_S:-70} python3 bench/profile_decode.py --batch ${shape%x*} --context ${shape#*x} \
            --kv-dtype fp8_e4m3 --fuse-prologue on --overlap-rows 2 --out "$OUT/halves_$shape" \
            >"$OUT/halves_$shape.log" 2>&1
        echo "== graphed decode step B x context $shape, whole vs halves: exit $?"
        grep -E '"graphed_step_ms(_halves)?"|Error' "$OUT/halves_$shape.log"
    done
    timeout -k 10 ${OVERLAP_S:-240} python3 bench/rollout_time_split.py --workload bench/long_workload.json \
        --kv-dtype fp8_e4m3 --overlap-rows ${OVERLAP_ROWS:-0,16} --out "$OUT" >"$OUT/rollout_time_split.log" 2>&1
    echo "== long rollout, whole vs halves: exit $?"
    grep -E "s = fixed|\(steady|warm-up rollout|Error" "$OUT/rollout_time_split.log" ;;
fixed)
    timeout -k 10 60 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging tests/test_skinny_linear.py \
        >"$OUT/skinny_tests.log" 2>&1; echo "== split-K GPU test: exit $?"; tail -1 "$OUT/skinny_tests.log"
    for pdl in 0 1; do       # each its own inductor cache: no kernel compiled one way reused the other
        export TORCHINDUCTOR_ENABLE_PDL=$pdl TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_pdl$pdl
        python3 -c "import torch._inductor.config as c; print('== inductor enable_pdl', getattr(c.triton, 'enable_pdl', 'absent'))"
        for shape in ${PDL_SHAPES:-32x2048 256x640}; do
            timeout -k 10 ${PDL_S:-90} python3 bench/profile_decode.py --batch ${shape%x*} --context ${shape#*x} \
                --kv-dtype fp8_e4m3 --fuse-prologue on --out "$OUT/pdl${pdl}_$shape" >"$OUT/pdl${pdl}_$shape.log" 2>&1
            echo "== decode step B x context $shape, PDL $pdl: exit $?"
            grep -E '"(graphed_step_ms|kernel_ms_per_step|kernels_per_step)"|Error' "$OUT/pdl${pdl}_$shape.log"
        done
    done
    unset TORCHINDUCTOR_ENABLE_PDL TORCHINDUCTOR_CACHE_DIR
    timeout -k 10 ${SWEEP_S:-140} python3 bench/decode_gemm_sweep.py --batch ${SWEEP_BATCH:-256,64,16} \
        --shapes ${SWEEP_SHAPES:-o,down,qkv,gate_up} \
        --impl cublas,splitk --out "$OUT" >"$OUT/decode_gemm_sweep.log" 2>&1
    echo "== decode GEMM sweep, cuBLAS vs split-K: exit $?"; grep -E "^(qkv|o|gate_up|down) |step|Error" "$OUT/decode_gemm_sweep.log" ;;
call0)
    steps_8b 300
    SECS_8B=240 bash bench/bigger_models.sh 8b-optoff-free ;;
h200)
    steps_8b 260
    split_long 300 ;;
h100)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True steps_8b 540 ;;
either)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $mib MiB"
    bash "$0" $([ "${mib:-0}" -gt 100000 ] && echo h200 || echo h100) ;;
rows)
    row() {   # name seconds args...
        local name=$1 secs=$2; shift 2
        FURLONG_BENCH_TIME_S=$((secs - 15)) timeout -k 5 "$secs" python3 -m furlong bench --output "$OUT/$name.json" \
            --parts train,rollout "$@" >"$OUT/$name.log" 2>&1; echo "== $name: exit $?"
        grep -E "memory plan|^step +(rollout|train|weight|whole)|^train +(train_tok_per_s|train_mfu|train_peak)" "$OUT/$name.log"
    }
    lora=(--lora-rank 64 --lora-alpha 128)
    for r in ${ROWS:-qwen3_1p7b seed_lora qwen3_1p7b_lora}; do
        case $r in
        qwen3_1p7b) row qwen3_1p7b 120 --workload bench/qwen3_1p7b_workload.json ;;
        seed_lora) row seed_lora 160 --workload bench/seed_workload.json "${lora[@]}" ;;
        qwen3_1p7b_lora) row qwen3_1p7b_lora 190 --workload bench/qwen3_1p7b_workload.json "${lora[@]}" ;;
        qwen3_4b_lora) row qwen3_4b_lora 200 --workload bench/qwen3_4b_workload.json "${lora[@]}" ;;
        *) echo "ROWS: unknown row $r" ;;
        esac
    done ;;
transposed)
    timeout -k 10 130 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging --timeout=90 \
        tests/test_kv_fp8_gpu.py >"$OUT/fp8_gpu_tests.log" 2>&1
    echo "== fp8 GPU tests: exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/fp8_gpu_tests.log" | tail -6
    timeout -k 10 140 python3 bench/decode_kernel_sweep.py --block-n 32,64 --kv fp8,fp8_t --warps 1,2 --stages 2 \
        --batch 256,64,12 --context 6144 --out "$OUT" >"$OUT/decode_kernel_sweep.log" 2>&1
    echo "== fp8 padded vs transposed, one layer: exit $?"; grep -E "B=|compiled|Error" "$OUT/decode_kernel_sweep.log"
    timeout -k 10 290 python3 bench/rollout_time_split.py --workload bench/long_workload.json --kv-dtype fp8_e4m3 \
        --fp8-kernel padded,transposed --out "$OUT" >"$OUT/rollout_time_split.log" 2>&1
    echo "== long rollout, padded vs transposed: exit $?"
    grep -E "s = fixed|\(steady|warm-up rollout|Error" "$OUT/rollout_time_split.log" ;;
cascade)
    timeout -k 10 150 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging --timeout=90 \
        tests/test_kv_fp8_gpu.py -k "cascade or transposed" >"$OUT/fp8_gpu_tests.log" 2>&1
    echo "== fp8 GPU tests (cascade, transposed): exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/fp8_gpu_tests.log" | tail -6
    timeout -k 10 390 python3 bench/rollout_time_split.py --workload bench/long_prompt_workload.json \
        --kv-dtype fp8_e4m3 --fp8-kernel transposed,transposed-all --out "$OUT" >"$OUT/rollout_time_split.log" 2>&1
    echo "== long-prompt rollout, transposed vs transposed-all: exit $?"
    grep -E "s = fixed|\(steady|warm-up rollout|Error" "$OUT/rollout_time_split.log" ;;
levers)
    timeout -k 10 330 python3 bench/decode_gemm_sweep.py --batch 256,128,64,16 --shapes qkv,o,gate_up,down \
        --impl cublas,cublaslt,autotune,autotune-dynamic --out "$OUT" >"$OUT/decode_gemm_sweep.log" 2>&1
    echo "== decode GEMM sweep: exit $?"; grep -E "^(qkv|o|gate_up|down) |step|Error" "$OUT/decode_gemm_sweep.log"
    timeout -k 10 160 python3 bench/decode_kernel_sweep.py --quick --kv fp8 --warps 1,2 --stages 2,3,4 \
        --batch 256,64,12 --context 4096,8192 --out "$OUT" >"$OUT/decode_kernel_sweep.log" 2>&1
    echo "== fp8 decode kernel sweep: exit $?"; grep -E "B=|compiled|Error" "$OUT/decode_kernel_sweep.log" ;;
call1)
    timeout -k 10 220 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging --timeout=90 \
        tests/test_weight_offload_gpu.py tests/test_offload_gpu.py tests/test_engine_gpu.py tests/test_kv_fp8_gpu.py \
        >"$OUT/gpu_tests.log" 2>&1
    echo "== weight release + offload + engine + fp8 GPU tests: exit $?"
    grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -6 ;;
call2)
    bash bench/bigger_models.sh decode-fp8
    split_long 310 ;;
call3)
    # the GPU preset cut to 100 rollouts (300 took 350 s on an H200, SFT included; 100 about 155-165 s on an
    # H100, where the first in a call once ran past 170 s), the baseline beside both
    # variants in one call; LoRA at 10x the full-parameter lr (3e-4 against 3e-5: LoRA's usual ratio, not tuned)
    for v in ${VARIANTS:-full lora fp8}; do
        args=(--set num_rollout=100)
        [ $v = lora ] && args+=(--set lora_rank=64 --set lora_alpha=128 --set grpo_lr=3e-4)
        [ $v = fp8 ] && args+=(--set rollout_kv_dtype=fp8_e4m3)
        timeout -k 10 $([ $v = lora ] && echo 240 || echo 200) python3 -m furlong demo --device cuda --output-dir "$OUT/demo_$v" "${args[@]}" \
            >"$OUT/demo_$v.log" 2>&1; echo "== demo $v: exit $?"; tail -2 "$OUT/demo_$v.log"
        cp "$OUT/demo_$v/evals.json" "$OUT/demo_${v}_evals.json" || continue   # the folder is too big to come back
        python3 -c "import json, sys; g = json.load(open(sys.argv[1]))['rollout_logprob_abs_diff']; \
print('mean |trainer - engine| log-prob', round(sum(v for _, v in g) / max(1, len(g)), 5))" "$OUT/demo_${v}_evals.json"
    done ;;
*) echo "usage: bash bench/pending_device.sh overlap|fixed|transposed|cascade|rows|levers|h100|call0|h200|either|call1|call2|call3"; exit 2 ;;
esac
