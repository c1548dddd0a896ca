#!/bin/bash
# Issue 61, 2026-11-28 (seventh stop): the weights a step reads held in huge pages (memory.weight_buffer). One idle
# run on 2 vCPUs of an AMD EPYC Zen 4 (lscpu.txt), the 256-bit builds forced with BATCHSPEC_CPU_ISA. From the
# repository root, with the main before this change checked out at $BEFORE (git worktree add $BEFORE 9256e23):
#   BEFORE=/tmp/before bash docs/results/2026-11-28g-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-28g-cpu
lscpu > $R/lscpu.txt
cat /sys/kernel/mm/transparent_hugepage/enabled > $R/thp.txt
# 1. One row's products from 4 KiB and 2 MiB pages, alternated in one process
PYTHONPATH=src python $R/pages_product.py 120 > $R/pages_product.json
# 2. The 1.5B target's plain step against its floor, before and after alternated, per bandwidth level
for isa in avx512vnni avxvnni avx2; do
    for quantize in int4 int8; do
        (cd "$BEFORE" && BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python "$OLDPWD/$R/step_bins.py" $quantize 40 before \
            2>/dev/null) >> $R/step_bins.jsonl
        BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python $R/step_bins.py $quantize 40 after 2>/dev/null >> $R/step_bins.jsonl
    done
done
# 3. What the pair holds once loaded, before and after
for quantize in int8 int4; do
    (cd "$BEFORE" && PYTHONPATH=src python "$OLDPWD/$R/held.py" $quantize before 2>/dev/null) >> $R/held.jsonl
    PYTHONPATH=src python $R/held.py $quantize after 2>/dev/null >> $R/held.jsonl
done
# 4. 8 HumanEval prompts x 64 new tokens, k auto, prefix caches off, the default build; OpenVINO GenAI int4 beside it
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
for quantize in int4 int8; do
    PYTHONPATH=src python -m batchspec bench "${BENCH[@]}" --quantize $quantize -o $R/bench64_${quantize}
done
.ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --weight-format int4 \
    --out $R/openvino64_int4.json
# 5. (run right after) the read bandwidth itself from 4 KiB and 2 MiB pages
PYTHONPATH=src python $R/pages_read.py 90 > $R/pages_read.json
