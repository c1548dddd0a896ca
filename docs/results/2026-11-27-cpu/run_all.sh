#!/bin/bash
# Issue 53, 2026-11-27: the AVX2 and AVX-VNNI builds of the int8 kernels beside the AVX-512 VNNI one, forced on this
# AVX-512 host (2 vCPUs of an AMD EPYC Zen 5; lscpu.txt) with BATCHSPEC_CPU_ISA; float32 capped at AVX2 likewise
# (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA); OpenVINO GenAI at its defaults and with
# OV_CPU_MAX_ISA/ONEDNN_MAX_CPU_ISA=AVX2. Idle machine, nothing else running. From the repository root, with a git
# worktree of the main before this issue (dc3e35c) at /tmp/ab_before and OpenVINO set up by scripts/openvino_setup.sh:
#   bash docs/results/2026-11-27-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-27-cpu
AVX2_FLOAT=(env ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
lscpu > $R/lscpu.txt
# 1. The product on the MLP's shape, streaming 30 distinct weights, every build and float32 (AVX2-capped, then not)
python $R/product_speed.py > $R/product_speed.jsonl
"${AVX2_FLOAT[@]}" python $R/product_speed.py float32 >> $R/product_speed.jsonl
python $R/product_speed.py float32 >> $R/product_speed.jsonl
# 2. A plain B = 1 step (and a B = 8 verification of 5 tokens) against its floor: each build, and the main before.
# (A first run's, before the 256-bit products streamed a panel in order, is step_floor_first.txt.)
for isa in avx2 avxvnni avx512vnni; do
    BATCHSPEC_CPU_ISA=$isa python docs/results/2026-11-26b-cpu/step_floor.py $isa 2>/dev/null | tail -1 >> $R/step_floor.txt
done
PYTHONPATH=/tmp/ab_before/src python docs/results/2026-11-26b-cpu/step_floor.py before 2>/dev/null | tail -1 >> $R/step_floor.txt
# 3. 8 HumanEval prompts x 64 new tokens, k auto, both prefix caches off: the avx2 build, the avx512vnni build,
# float32 capped at AVX2, OpenVINO GenAI (its defaults; then capped at AVX2)
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
BATCHSPEC_CPU_ISA=avx2 python -m batchspec bench "${BENCH[@]}" -o $R/bench64_avx2
BATCHSPEC_CPU_ISA=avx512vnni python -m batchspec bench "${BENCH[@]}" -o $R/bench64_avx512vnni
"${AVX2_FLOAT[@]}" python -m batchspec bench "${BENCH[@]}" --quantize none --no-compare -o $R/bench64_float32_avx2
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64.json
OV_CPU_MAX_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 /work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 \
    --max-new-tokens 64 --out $R/openvino64_avx2cap.json
# 4. The prompt reading (prefill_s of plain decoding, 16 new tokens): the avx2 build against float32 capped at AVX2
PREFILL=(--preset qwen2.5-coder -n 8 --max-new-tokens 16 --batch-sizes 1,8 --methods autoregressive --no-compare
         --prefix-cache-size 0)
BATCHSPEC_CPU_ISA=avx2 python -m batchspec bench "${PREFILL[@]}" -o $R/prefill_avx2
"${AVX2_FLOAT[@]}" python -m batchspec bench "${PREFILL[@]}" --quantize none -o $R/prefill_float32_avx2
# 5. The README's demo (4 HumanEval problems, B = 4, 128 new tokens), on the avx2 build and on this host's default
BATCHSPEC_CPU_ISA=avx2 bash scripts/setup.sh demo > $R/demo_avx2.txt 2>&1
bash scripts/setup.sh demo > $R/demo_avx512vnni.txt 2>&1
