#!/usr/bin/env bash
# The device measurements still owed by the open issues, batched into device calls whose pieces'
# timeouts add up to <= 530 s, most important first (a session's 30 device minutes hold about three):
#   bash bench/pending_device.sh call1|call2|call3|call4|call5
# call1  GPU tests (all, with the offload/reference ones added in session 10), the seed step after the
#        session 9-10 merges, LoRA applied in the engine's forward vs merged
# call2  Qwen3-8B full-parameter with --fsdp-cpu-offload (the fused CPU AdamW); the KL reference resident
#        vs in CPU memory at the 4B shape
# call3  the mixed-step GPU test, multi-turn vs single turn (issue 22's <= 1.2x: mixed, unmixed and
#        min_admit 1 side by side), the GPU tool-use demo
# call4  the long RL step with --partial-rollout (2 steps) and its step 2 again without, on 16 prompts
#        (bench/long_rlstep_workload.json: the full long step's 4 steps do not fit one call); Qwen3-1.7B
# call5  Qwen3-4B LoRA; where the long workload's train step goes (issue 21: attention's FLOPs, by arithmetic)
# Everything lands in $OUT (logs, JSON, plots); each piece is bounded by `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case ${1:-} in
call1)
    timeout -k 10 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=180 tests >"$OUT/gpu_tests.log" 2>&1
    echo "== gpu tests: exit $?"; tail -3 "$OUT/gpu_tests.log"
    FURLONG_BENCH_TIME_S=130 timeout -k 10 150 python3 -m furlong bench --workload bench/seed_workload.json \
        --parts train,rollout --output "$OUT/seed.json" >"$OUT/seed.log" 2>&1
    echo "== seed step: exit $?"; grep -E "^step " "$OUT/seed.log"
    bash bench/bigger_models.sh lora-apply ;;
call2)
    bash bench/bigger_models.sh 8b-offload 4b-ref ;;
call3)
    timeout -k 10 100 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=90 tests/test_engine_mixed.py \
        >"$OUT/mixed_gpu.log" 2>&1; echo "== mixed-step GPU test: exit $?"; tail -2 "$OUT/mixed_gpu.log"
    timeout -k 10 150 python3 bench/multiturn.py --output "$OUT/multiturn.json" >"$OUT/multiturn.log" 2>&1
    echo "== multiturn: exit $?"; grep ratio "$OUT/multiturn.json"
    timeout -k 10 280 python3 -m furlong demo --task calculator --device cuda --output-dir "$OUT/tool_demo_gpu" \
        >"$OUT/tool_demo_gpu.log" 2>&1
    echo "== tool demo: exit $?"; tail -5 "$OUT/tool_demo_gpu.log" ;;
call4)
    FURLONG_BENCH_TIME_S=270 FURLONG_BENCH_GUARD_S=260 timeout -k 10 280 python3 -m furlong bench \
        --workload bench/long_rlstep_workload.json --parts rlstep --output "$OUT/long_rlstep.json" >"$OUT/long_rlstep.log" 2>&1
    echo "== long rlstep: exit $?"; grep -E "rlstep" "$OUT/long_rlstep.log" | tail -12
    bash bench/bigger_models.sh 1p7b ;;
call5)
    bash bench/bigger_models.sh 4b-lora
    timeout -k 10 200 python3 bench/profile_train.py --workload bench/long_workload.json --label long \
        --out "$OUT" >"$OUT/profile_train_long.log" 2>&1
    echo "== profile long train step: exit $?"; tail -20 "$OUT/profile_train_long.log" ;;
*) echo "usage: bash bench/pending_device.sh call1|call2|call3|call4|call5"; exit 2 ;;
esac
