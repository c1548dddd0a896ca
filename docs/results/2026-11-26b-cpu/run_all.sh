#!/bin/bash
# Issue 35, 2026-11-26 (second stop): the int8 model's own forward (int8/forward.py) against the main before it, then
# this code against OpenVINO GenAI, idle machine, nothing else running. From the repository root, with git worktrees
# of the main before (459a184) at /tmp/ab_base and of this code at /tmp/ab_after:
#   bash docs/results/2026-11-26b-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-26b-cpu
lscpu > $R/lscpu.txt
for i in 1 2 3; do
    PYTHONPATH=/tmp/ab_base/src python $R/step_floor.py before 2>/dev/null | tail -1 >> $R/step_floor.txt
    PYTHONPATH=/tmp/ab_after/src python $R/step_floor.py after 2>/dev/null | tail -1 >> $R/step_floor.txt
done
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" -o $R/bench64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64_nocache.json
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" -o $R/summaries64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/openvino_summaries64_nocache.json
