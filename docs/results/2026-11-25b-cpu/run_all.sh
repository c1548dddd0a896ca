#!/bin/bash
# Issue 35's measurements of this stop, one after another on the idle machine (nothing else running).
# BEFORE is a checkout of the previous main (d8e0af2: torch._int_mm on [in, out] weights, RMSNorm's pairwise tree);
# AFTER is this stop's code. From the repository root:
#   git worktree add /tmp/before d8e0af2 && bash docs/results/2026-11-25b-cpu/run_all.sh /tmp/before
set -x
R=docs/results/2026-11-25b-cpu
BEFORE=${1:-/tmp/before}
lscpu > $R/lscpu.txt
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec costs --preset qwen2.5-coder --batch-sizes 1,8 --draft-lengths 4 --repeats 5 \
        -o $R/costs_$side
    PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 \
        --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/bench64_$side
done
# OpenVINO GenAI on the same token ids, in its own venv (scripts/openvino_setup.sh)
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64.json
# (quality: the answers are those of the previous main, bit for bit, so docs/results/2026-11-24e/quality.json stands;
#  mean_square/ holds the run of an abandoned RMSNorm variant)
