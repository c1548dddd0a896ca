#!/usr/bin/env bash
# GPU call 3: timings one at a time (same machine for every comparison), then a host profile.
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
R=/tmp/r; mkdir -p $R
pack() { tar czf $OUT/results.tgz -C /tmp r; }
G="python3 scripts/gpu_check.py"
T0=$(date +%s)
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim $G "$@" --out $R/$name > $R/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s"; pack; }
step tp_on 75 throughput --cells batchspec --cuda-graphs on
step tp_off8 60 throughput --cells batchspec --sizes 8
step tp_inv8 60 throughput --cells batchspec --batch-invariant --sizes 8
step tp_inv8_on 60 throughput --cells batchspec --batch-invariant --sizes 8 --cuda-graphs on
step hybrid_on 70 hybrid --sizes 1,8 --cuda-graphs on
step peers 220 throughput --cells peers
s=$(date +%s); timeout 40 python3 -m cProfile -s tottime scripts/gpu_check.py throughput --cells batchspec --cuda-graphs on --sizes 1 --new-tokens 64 > $R/profile_b1.txt 2>&1; echo "profile $(( $(date +%s) - s )) s"; pack
echo "total $(( $(date +%s) - T0 )) s"
