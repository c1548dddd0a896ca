#!/bin/bash
# Issue 35, this session: the stacked products (ba839e5) against the main before them (58b60e2) and OpenVINO GenAI,
# 8 HumanEval prompts, 64 new tokens, on the idle machine, alternated. Each code from its own git worktree:
#   git worktree add /tmp/ab_base 58b60e2; git worktree add /tmp/ab_after ba839e5
#   bash docs/results/2026-11-26-cpu/run_stacked.sh
set -x
R=docs/results/2026-11-26-cpu
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid)
for run in 1 2; do
    PYTHONPATH=/tmp/ab_base/src python -m batchspec bench "${BENCH[@]}" -o $R/stacked${run}_bench64_before
    PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" -o $R/stacked${run}_bench64_after
    /work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/stacked${run}_openvino64.json
done
