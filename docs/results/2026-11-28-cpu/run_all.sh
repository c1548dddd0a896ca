#!/bin/bash
# Issue 61, 2026-11-28: --quantize int4 beside int8, on every native build this AVX-512 host runs (2 vCPUs of an AMD
# EPYC Zen 4; lscpu.txt), the 256-bit ones forced with BATCHSPEC_CPU_ISA; OpenVINO GenAI int4 and int8 (its CPU
# defaults, then capped at AVX2). Idle machine, nothing else running; OpenVINO set up by scripts/openvino_setup.sh.
# From the repository root:
#   bash docs/results/2026-11-28-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-28-cpu
export PYTHONPATH=src
lscpu > $R/lscpu.txt
# 1. The products on the MLP's shapes, streaming 30 distinct weights, every build, int8 and int4
python $R/product_speed.py > $R/product_speed.jsonl
# 2. Plain B = 1 steps and verifications (B = 1 and 8, 5 tokens) against their floors: each build, int8 and int4
for isa in avx512vnni avxvnni avx2; do
    for quantize in int8 int4; do
        BATCHSPEC_CPU_ISA=$isa python $R/step_floor.py $quantize 2>/dev/null | tail -1 >> $R/step_floor.txt
    done
done
# 3. 8 HumanEval prompts x 64 new tokens, k auto, prefix caches off: int4 and int8 on avx512vnni and avx2; OpenVINO
# GenAI int4 and int8 at its defaults and capped at AVX2
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
for isa in avx512vnni avx2; do
    for quantize in int4 int8; do
        BATCHSPEC_CPU_ISA=$isa python -m batchspec bench "${BENCH[@]}" --quantize $quantize -o $R/bench64_${quantize}_$isa
    done
done
for format in int4 int8; do
    .ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --weight-format $format \
        --out $R/openvino64_$format.json
    OV_CPU_MAX_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 .ov-venv/bin/python scripts/openvino_compare.py --limit 8 \
        --max-new-tokens 64 --weight-format $format --out $R/openvino64_${format}_avx2cap.json
done
# 4. Memory: the peak resident set of the README's demo run, int4 and int8
for quantize in int4 int8; do
    /usr/bin/time -v python -m batchspec generate --prompts humaneval --limit 4 --batch-size 4 --max-new-tokens 128 \
        --quantize $quantize > $R/demo_$quantize.txt 2>&1
done
