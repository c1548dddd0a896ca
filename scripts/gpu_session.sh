#!/usr/bin/env bash
# Issue 39's device checks as one command that ends by a deadline: each step runs under `timeout` (its own limit or
# what is left, whichever is less), writes its log and JSON under $RESULTS, and the folder is packed into
# $OUT/results.tgz after every step, so a run cut short still brings back every step that finished.
#
#   PYTHONPATH=src bash scripts/gpu_session.sh 540            # on the device machine: seconds of work at most
#   PYTHONPATH=src bash scripts/gpu_session.sh 120 --small    # here, on the CPU: a smoke test of the steps
#
# On an H200 (2026-11-26) the steps before the peers took 8 minutes and the peers (transformers' compiled generate,
# which compiles for each batch size) 72 s each: with 15 minutes of device time, run the peers in a second call on
# the warm machine (docs/results/2026-11-26-gpu/calls.sh).
set -u
BUDGET=${1:-540}
SMALL=${2:-}
OUT=${OUT:-/tmp/gpu_session_out}
RESULTS=${RESULTS:-/tmp/gpu_session}
mkdir -p "$OUT" "$RESULTS"
DEADLINE=$(( $(date +%s) + BUDGET ))
export PYTHONUNBUFFERED=1
CHECK="python3 scripts/gpu_check.py"
if [ -n "$SMALL" ]; then CHECK="$CHECK --device cpu --small"; fi

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2 left
    shift 2
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left}s left" | tee -a "$RESULTS/steps.txt"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    local started=$(date +%s)
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $(( $(date +%s) - started ))s (limit ${limit}s)" | tee -a "$RESULTS/steps.txt"
    tail -3 "$RESULTS/$name.log"
    tar czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
}

{ nvidia-smi; python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__,
  triton.__version__)"; lscpu | head -20; } > "$RESULTS/machine.txt" 2>&1

if [ -z "$SMALL" ]; then
    step pytest_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_graphs.py tests/test_runner.py \
        tests/test_invariant.py
fi
step syncs 60 $CHECK syncs --out "$RESULTS/syncs"
step equivalence_f32_graphs_off 90 $CHECK equivalence --out "$RESULTS/eq_f32_off"
step equivalence_f32_graphs_on 90 $CHECK equivalence --cuda-graphs on --out "$RESULTS/eq_f32_on"
step invariance_bf16 60 $CHECK invariance --tiny-dtype bfloat16 --out "$RESULTS/inv_bf16"
step equivalence_bf16_invariant 90 $CHECK equivalence --tiny-dtype bfloat16 --batch-invariant \
    --out "$RESULTS/eq_bf16_inv"
step costs_graphs_off 60 $CHECK costs --out "$RESULTS/costs_off"
step costs_graphs_on 60 $CHECK costs --cuda-graphs on --out "$RESULTS/costs_on"
step throughput_graphs_off 90 $CHECK throughput --cells batchspec --out "$RESULTS/tp_off"
step throughput_graphs_on 90 $CHECK throughput --cells batchspec --cuda-graphs on --out "$RESULTS/tp_on"
step throughput_invariant_b8 60 $CHECK throughput --cells batchspec --sizes 8 --batch-invariant \
    --out "$RESULTS/tp_inv"
step hybrid_b8 60 $CHECK hybrid --sizes 8 --out "$RESULTS/hybrid"
for size in 1 8 32; do
    step "throughput_peers_b$size" 120 $CHECK throughput --cells peers --sizes "$size" --out "$RESULTS/tp_peers_b$size"
done
echo "done: $(( DEADLINE - $(date +%s) ))s to spare"
