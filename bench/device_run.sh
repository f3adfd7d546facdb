#!/usr/bin/env bash
# The one command for the GPU machine (run from anywhere; it cds to the repo root):
#   bash bench/device_run.sh [--parts train,hf,rollout,decode,eval,trl,budget]
# Writes $OUT/bench.json (rewritten after every part), $OUT/bench.log and
# $OUT/nvidia-smi.txt; OUT defaults to bench/out. No network: the package runs from the
# checkout via PYTHONPATH (and the trl part's wheels, if carried in .whl, from /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
# The trl part's packages (TRL, datasets; not furlong dependencies), when their wheels were carried
# in .whl (bench/README.md): installed without network or dependencies into /tmp/site, so the
# device's own torch/transformers stay as they are.
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl >"$OUT/pip-whl.log" 2>&1; then
        SITE="/tmp/site"
    else
        echo "device_run: installing .whl/*.whl failed (see $OUT/pip-whl.log); the trl part will fail"
    fi
fi
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
# furlong bench stops starting parts after FURLONG_BENCH_TIME_S; keep it under the 600 s device call.
export FURLONG_BENCH_TIME_S="${FURLONG_BENCH_TIME_S:-480}"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
# Hard stop before the device call's own limit, so $OUT (partial JSON, log) always comes back.
timeout -k 10 560 python3 -m furlong bench --workload bench/seed_workload.json \
    --output "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "device_run: exit code $rc (0: every part ok; 1: some part failed, see bench.json; 124: killed at 560 s)"
exit "$rc"
