#!/usr/bin/env bash
# The one command for the GPU machine (run from anywhere; it cds to the repo root):
#   bash bench/device_run.sh [--parts train,budget,hf,rollout,decode]
# Writes $OUT/bench.json (rewritten after every part), $OUT/bench.log and
# $OUT/nvidia-smi.txt; OUT defaults to bench/out. No network and no install:
# the package runs from the checkout via PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# furlong bench stops starting parts after FURLONG_BENCH_TIME_S; keep it under the 600 s device call.
export FURLONG_BENCH_TIME_S="${FURLONG_BENCH_TIME_S:-480}"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
# Hard stop before the device call's own limit, so $OUT (partial JSON, log) always comes back.
timeout -k 10 560 python3 -m furlong bench --workload bench/seed_workload.json \
    --output "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "device_run: exit code $rc (0: every part ok; 1: some part failed, see bench.json; 124: killed at 560 s)"
exit "$rc"
