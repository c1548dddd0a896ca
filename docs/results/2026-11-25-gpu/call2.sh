#!/usr/bin/env bash
# GPU call 2: correctness fixes re-checked in parallel, then timings one at a time.
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
R=/tmp/r; mkdir -p $R
pack() { tar czf $OUT/results.tgz -C /tmp r; }
G="python3 scripts/gpu_check.py"
T0=$(date +%s)
( timeout 170 python3 -m pytest -p no:cacheprovider -q -rfEs --durations=8 tests/test_invariant.py > $R/pytest_invariant.txt 2>&1 ) &
( timeout 170 $G invariance --tiny-dtype bfloat16 --out $R/inv_bf16 > $R/inv_bf16.log 2>&1 ) &
( timeout 170 $G invariance --tiny-dtype float32 --out $R/inv_f32 > $R/inv_f32.log 2>&1 ) &
( timeout 170 $G equivalence --out $R/eq_off > $R/eq_off.log 2>&1 ) &
( timeout 170 $G equivalence --tiny-dtype bfloat16 --batch-invariant --out $R/eq_bf16_inv > $R/eq_bf16_inv.log 2>&1 ) &
( timeout 170 $G equivalence --tiny-dtype bfloat16 --batch-invariant --cuda-graphs on --out $R/eq_bf16_inv_on > $R/eq_bf16_inv_on.log 2>&1 ) &
wait; pack; echo "correctness done $(( $(date +%s) - T0 )) s"
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim $G "$@" --out $R/$name > $R/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s"; pack; }
step costs_off 80 costs
step costs_on 80 costs --cuda-graphs on
step tp_off 110 throughput --cells batchspec
step tp_on 110 throughput --cells batchspec --cuda-graphs on
step hybrid 80 hybrid --sizes 1,8
step tp_inv 80 throughput --cells batchspec --batch-invariant --sizes 8
echo "total $(( $(date +%s) - T0 )) s"
tail -3 $R/pytest_invariant.txt
