#!/bin/bash
# Issue 61, 2026-11-28 (fifth stop): every decoder layer in one native call (csrc/decoder.h). One idle run on 2 vCPUs
# of an AMD EPYC Zen 4 (lscpu.txt), the avx2 build forced with BATCHSPEC_CPU_ISA; OpenVINO GenAI int4 at its CPU
# defaults and capped at AVX2 (set up by scripts/openvino_setup.sh). From the repository root, with the main before
# this change checked out at $BEFORE (git worktree add $BEFORE 64850c4):
#   BEFORE=/tmp/before bash docs/results/2026-11-28e-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-28e-cpu
STEP=docs/results/2026-11-28-cpu/step_floor.py
lscpu > $R/lscpu.txt
# 1. The 1.5B target's steps against their floors, this main and the one before alternated, each build and width
for isa in avx512vnni avx2; do
    for quantize in int4 int8; do
        (cd "$BEFORE" && BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python $STEP $quantize 2>/dev/null | tail -1 \
            | sed 's/^/before /') >> $R/step_floor.txt
        BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python $STEP $quantize 2>/dev/null | tail -1 | sed 's/^/after  /' \
            >> $R/step_floor.txt
    done
done
# 2. 8 HumanEval prompts x 64 new tokens, k auto, prefix caches off: int4 and int8 on avx512vnni and avx2
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
for isa in avx512vnni avx2; do
    for quantize in int4 int8; do
        BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python -m batchspec bench "${BENCH[@]}" --quantize $quantize \
            -o $R/bench64_${quantize}_$isa
    done
done
# 3. OpenVINO GenAI int4, its defaults and capped at AVX2
.ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --weight-format int4 \
    --out $R/openvino64_int4.json
OV_CPU_MAX_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 .ov-venv/bin/python scripts/openvino_compare.py --limit 8 \
    --max-new-tokens 64 --weight-format int4 --out $R/openvino64_int4_avx2cap.json
