#!/bin/bash
# Issue 35's measurements of this stop, one after another on the idle machine (nothing else running).
# BEFORE is a checkout of the previous main (0882bda: float64 KV cache, the native attention in float64);
# AFTER is this stop's code (the int16 KV cache and its native attention). OpenVINO GenAI runs in its own venv
# (scripts/openvino_setup.sh). From the repository root:
#   git worktree add /tmp/before 0882bda && bash docs/results/2026-11-25d-cpu/run_all.sh /tmp/before
set -x
R=docs/results/2026-11-25d-cpu
BEFORE=${1:-/tmp/before}
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
lscpu > $R/lscpu.txt
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec costs --preset qwen2.5-coder --batch-sizes 1,8 --draft-lengths 4 --repeats 5 \
        -o $R/costs_$side
    PYTHONPATH=$src python -m batchspec costs --preset qwen2.5-coder --batch-sizes 8 --draft-lengths 4 --repeats 3 \
        --context 1024 -o $R/costs1024_$side
done
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder "${SUMMARIES[@]}" -n 8 --max-new-tokens 64 \
        --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/summaries64_$side
done
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/openvino_summaries64.json
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 \
        --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/bench64_$side
done
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64.json
