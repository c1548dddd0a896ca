#!/bin/bash
# Issue 35, 2026-11-26 (fourth stop): pass@1 on all 164 HumanEval problems of the 2-byte KV cache (this stop's first
# commit, 6d1a386, at /tmp/ab_kv200), of the 2.06-byte one (the main before it, 6252ed8, at /tmp/ab_kv206) and of
# float32, one after another on an otherwise quiet machine (the answers do not depend on timing):
#   bash docs/results/2026-11-26e-cpu/quality_all.sh
# The first 40 problems of the 2-byte cache (quality.txt, quality.json), float32's answers reused:
#   PYTHONPATH=/tmp/ab_kv200/src python docs/results/2026-11-24e/quality.py \
#       --reuse-float32 docs/results/2026-11-24e/quality_first.json --out docs/results/2026-11-26e-cpu/quality.json
source .venv/bin/activate
R=docs/results/2026-11-26e-cpu
for code in kv200 kv206; do
    PYTHONPATH=/tmp/ab_$code/src python $R/quality_all.py int8 --out $R/quality_all_$code.json >> $R/quality_all.txt
done
PYTHONPATH=/tmp/ab_kv200/src python $R/quality_all.py none --out $R/quality_all_float32.json >> $R/quality_all.txt
