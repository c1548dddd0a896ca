#!/bin/bash
# Issue 35: the native product streaming its weight once per 240 rows instead of 60 (native.c's ROW_BLOCK) against the
# code before (58b60e2), 8 HumanEval prompts, 64 new tokens, alternated twice, on the idle machine:
#   git worktree add /tmp/ab_base 58b60e2; git worktree add /tmp/ab_after 58b60e2   # then native.c of this commit
#   bash docs/results/2026-11-26-cpu/run_row_block.sh
set -x
R=docs/results/2026-11-26-cpu
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid)
for run in 1 2; do
    PYTHONPATH=/tmp/ab_base/src python -m batchspec bench "${BENCH[@]}" -o $R/rowblock${run}_bench64_before
    PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" -o $R/rowblock${run}_bench64_after
done
