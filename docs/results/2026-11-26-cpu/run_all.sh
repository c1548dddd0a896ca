#!/bin/bash
# Issues 37 and 38's measurements of this stop, one after another on the idle machine (nothing else running).
# BEFORE is a checkout of the previous main (d5d58ba: no prefix cache, no shaping); AFTER is this stop's code, the
# prefix cache at its default (auto). From the repository root:
#   git worktree add /tmp/before d5d58ba && bash docs/results/2026-11-26-cpu/run_all.sh /tmp/before
set -x
R=docs/results/2026-11-26-cpu
BEFORE=${1:-/tmp/before}
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
lscpu > $R/lscpu.txt
python scripts/prefix_bench.py --preset qwen2.5-coder --out $R/prefix.json > /dev/null
python scripts/structured_bench.py --preset qwen2.5-coder --objects 200 --out $R/structured.json > /dev/null
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 \
        --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/bench64_$side
done
for side in before after; do
    src=src; [ $side = before ] && src=$BEFORE/src
    PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder "${SUMMARIES[@]}" -n 8 --max-new-tokens 64 \
        --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/summaries64_$side
done
# The summarization run above showed the cache costing B=8 (rows waited for a row sharing only the chat template's
# 32 tokens, then decoded out of step: realignments). With rows waiting only where they share >= 25% of what they
# would read (prefix_cache.worth_waiting), summarization again, alternated before/after twice (this host's memory
# bandwidth drifts between runs minutes apart):
for round in 1 2; do
    for side in before after; do
        src=src; [ $side = before ] && src=$BEFORE/src
        PYTHONPATH=$src python -m batchspec bench --preset qwen2.5-coder "${SUMMARIES[@]}" -n 8 --max-new-tokens 64 \
            --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid --no-compare \
            -o $R/ab${round}_summaries64_$side
    done
done
