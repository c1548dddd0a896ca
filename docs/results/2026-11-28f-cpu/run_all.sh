#!/bin/bash
# Issue 61, 2026-11-28 (sixth stop): the 256-bit builds' int8 product with llama.cpp's sign trick and one row read in
# one pass (int8 and int4). One idle run on 2 vCPUs of an AMD EPYC Zen 4 (lscpu.txt), the 256-bit builds forced with
# BATCHSPEC_CPU_ISA. From the repository root, with the main before this change checked out at $BEFORE
# (git worktree add $BEFORE 2c952d3):
#   BEFORE=/tmp/before bash docs/results/2026-11-28f-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-28f-cpu
STEP=docs/results/2026-11-28-cpu/step_floor.py
lscpu > $R/lscpu.txt
# 1. The products, before and after alternated, each 256-bit build
for round in 1; do
    for isa in avx2 avxvnni; do
        (cd "$BEFORE" && PYTHONPATH=src python "$OLDPWD/$R/product_ab.py" $isa before) >> $R/product_ab.jsonl
        PYTHONPATH=src python $R/product_ab.py $isa after >> $R/product_ab.jsonl
    done
done
# 2. The 1.5B target's steps against their floors, before and after alternated
for isa in avx2 avxvnni; do
    for quantize in int8 int4; do
        (cd "$BEFORE" && BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python $STEP $quantize 2>/dev/null | tail -1 \
            | sed "s/^/before $isa /") >> $R/step_floor.txt
        BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python $STEP $quantize 2>/dev/null | tail -1 \
            | sed "s/^/after  $isa /" >> $R/step_floor.txt
    done
done
# 3. 8 HumanEval prompts x 64 new tokens, k auto, prefix caches off, the avx2 build
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
for quantize in int4 int8; do
    BATCHSPEC_CPU_ISA=avx2 PYTHONPATH=src python -m batchspec bench "${BENCH[@]}" --quantize $quantize \
        -o $R/bench64_${quantize}_avx2
done
# 4. OpenVINO GenAI int4 capped at AVX2 (scripts/openvino_setup.sh)
OV_CPU_MAX_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 .ov-venv/bin/python scripts/openvino_compare.py --limit 8 \
    --max-new-tokens 64 --weight-format int4 --out $R/openvino64_int4_avx2cap.json
