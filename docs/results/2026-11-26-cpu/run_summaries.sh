#!/bin/bash
# Issue 35: this stop's code against OpenVINO GenAI on the 8 SpecBench summarization prompts (422-1,154 tokens), 64 new
# tokens, both prefix caches off, idle machine. From the repository root:
#   bash docs/results/2026-11-26-cpu/run_summaries.sh
set -x
R=docs/results/2026-11-26-cpu
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
PYTHONPATH=src python -m batchspec bench --preset qwen2.5-coder "${SUMMARIES[@]}" -n 8 --max-new-tokens 64 \
    --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid --prefix-cache-size 0 \
    -o $R/final_summaries64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/final_openvino_summaries64_nocache.json
