#!/usr/bin/env bash
# Device runs behind BENCHMARKS.md "Bigger models, fp8 KV": each step writes JSON/logs into $OUT.
#   bash bench/bigger_models.sh PART...   PART: gpu-tests | decode-fp8 | seed-fp8 | 4b | 4b-optoff | 4b-lora |
#                                               8b-offload | 8b-optoff | 8b-optoff-reshard | 8b-optoff-free | 8b-lora | long-fp8 | long-bf16 | long-fp8-only | 1p7b | 4b-ref | lora-apply
# Every run is bounded by `timeout` so that $OUT always comes back within the device call
# (SECS_8B: 8b-optoff's bound, default 400 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bench() {  # name seconds args...
    local name=$1 secs=$2; shift 2
    FURLONG_BENCH_TIME_S=$((secs - 20)) timeout -k 10 "$secs" python3 -m furlong bench --output "$OUT/$name.json" "$@" \
        >"$OUT/$name.log" 2>&1
    echo "== $name: exit $?"; grep -E "^(step|train +(train_step_s |train_tok|train_mfu|train_peak|num_micro|planned|gradient|cpu_off|optimizer_|weight_sync_s)|rollout +(seconds|tok_per|first_sec|kv_cache|status))|memory plan|Error|error" "$OUT/$name.log" | head -40
}
for part in "$@"; do
    case $part in
    lora-gpu) timeout -k 10 200 python3 -m pytest -m gpu -q -s --timeout=180 -p no:cacheprovider tests/test_lora_gpu.py \
                   >"$OUT/lora_gpu.log" 2>&1; echo "== lora-gpu: exit $?"; grep -E "passed|failed|gap|FAILED" "$OUT/lora_gpu.log" | tail -5 ;;
    gpu-tests) timeout -k 10 300 python3 -m pytest -m gpu -q -s --timeout=240 -p no:cacheprovider \
                   tests/test_kv_fp8_gpu.py tests/test_engine_gpu.py tests/test_actor.py tests/test_offload_gpu.py >"$OUT/gpu_tests.log" 2>&1
               echo "== gpu-tests: exit $?"; grep -E "passed|failed|gap|FAILED" "$OUT/gpu_tests.log" | tail -8 ;;
    decode-fp8) timeout -k 10 150 python3 bench/profile_decode.py --batch 256 --context 640 --kv-dtype bf16,fp8_e4m3 \
                   --fuse-prologue on --residual-add both --out "$OUT" >"$OUT/profile_decode.log" 2>&1; echo "== decode-fp8: exit $?"
                python3 -c "import json; d=json.load(open('$OUT/profile_decode.json')); [print(r['kv_dtype'], 'residual', r['residual_add'], round(r['graphed_step_ms'], 3), 'ms/step', round(r['kernel_ms_per_step'], 3), 'ms of kernels', r['kernels_per_step'], 'kernels') for r in d.get('runs', [d])]" ;;
    seed-fp8) bench seed_bf16 200 --workload bench/seed_workload.json --parts rollout
              bench seed_fp8 200 --workload bench/seed_workload.json --parts rollout --kv-dtype fp8_e4m3 ;;
    1p7b) bench qwen3_1p7b 240 --workload bench/qwen3_1p7b_workload.json --parts train,rollout ;;
    # the KL reference resident vs in CPU memory (--ref-placement): GPU memory held, pass time
    4b-ref) bench qwen3_4b_ref 200 --workload bench/qwen3_4b_workload.json --parts ref ;;
    # LoRA applied in the engine's forward vs merged at sync: the projections' extra time per decode step
    lora-apply) timeout -k 10 120 python3 bench/lora_engine_cost.py --workload bench/qwen3_8b_workload.json \
                   --out "$OUT" >"$OUT/lora_engine_cost.log" 2>&1; echo "== lora-apply: exit $?"; tail -14 "$OUT/lora_engine_cost.log" ;;
    4b) bench qwen3_4b 300 --workload bench/qwen3_4b_workload.json --parts train,rollout ;;
    # AdamW's moments in CPU memory, streamed to the GPU per update (--optimizer-cpu-offload): beside plain 4b,
    # and the 8B full-parameter shape that neither the GPU alone nor --fsdp-cpu-offload's host can hold
    4b-optoff) bench qwen3_4b_optoff 300 --workload bench/qwen3_4b_workload.json --parts train,rollout \
                   --optimizer-cpu-offload ;;
    8b-optoff) FURLONG_BENCH_GUARD_S=$((${SECS_8B:-400} - 40)) bench qwen3_8b_optoff ${SECS_8B:-400} --workload bench/qwen3_8b_workload.json --parts train \
                   --optimizer-cpu-offload ;;
    # an 80 GB card: 8B's fp32 weights and gradients (61 GiB) and its gathered bf16 copy (15 GiB) left no room
    # for a 4096-token probe (an H100, BENCHMARKS.md); resharding after forward frees the gathered copy (the
    # memory plan turns it on by itself when nothing fits without it: this part asks for it up front)
    8b-optoff-reshard) FURLONG_BENCH_GUARD_S=360 bench qwen3_8b_optoff_reshard 400 --workload bench/qwen3_8b_workload.json \
                   --parts train --optimizer-cpu-offload --fsdp-reshard-after-forward ;;
    # and the engine's weights given back while the actor trains (--offload-rollout-level weight): on an 80 GB
    # card 61 GiB of fp32 weights and gradients leave no room for the engine's 15 GiB beside them
    8b-optoff-free) FURLONG_BENCH_GUARD_S=$((${SECS_8B:-400} - 40)) bench qwen3_8b_optoff_free ${SECS_8B:-400} \
                   --workload bench/qwen3_8b_workload.json --parts train --optimizer-cpu-offload \
                   --offload-rollout-level kv_cache weight ;;
    8b-offload) FURLONG_BENCH_GUARD_S=280 bench qwen3_8b_offload 310 --workload bench/qwen3_8b_workload.json --parts train --fsdp-cpu-offload ;;
    8b-lora) FURLONG_BENCH_GUARD_S=200 bench qwen3_8b_lora 300 --workload bench/qwen3_8b_workload.json --parts train,rollout --lora-rank 64 \
                 --lora-alpha 128 ;;
    4b-lora) bench qwen3_4b_lora 300 --workload bench/qwen3_4b_workload.json --parts train,rollout --lora-rank 64 \
                 --lora-alpha 128 ;;
    long-fp8) bash "$0" long-bf16 long-fp8-only ;;      # both, bf16 first
    long-bf16) FURLONG_BENCH_GUARD_S=270 bench long_bf16 300 --workload bench/long_workload.json --parts rollout ;;
    long-fp8-only) FURLONG_BENCH_GUARD_S=270 bench long_fp8 300 --workload bench/long_workload.json --parts rollout \
                       --kv-dtype fp8_e4m3 ;;
    *) echo "unknown part $part" ;;
    esac
done
