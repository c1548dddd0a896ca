#!/bin/bash
# The second run of this stop (after run_all.sh), on the idle machine: this stop's final code (the int16 KV cache, and
# the native attention for prefill too) against OpenVINO GenAI again, both prompt sets. From the repository root:
#   bash docs/results/2026-11-25d-cpu/run_prefill.sh
set -x
R=docs/results/2026-11-25d-cpu
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
PYTHONPATH=src python -m batchspec bench --preset qwen2.5-coder "${SUMMARIES[@]}" -n 8 --max-new-tokens 64 \
    --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/summaries64_final
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/openvino_summaries64_run2.json
PYTHONPATH=src python -m batchspec bench --preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 \
    --methods autoregressive,eqspec --proposers ngram,hybrid -o $R/bench64_final
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64_run2.json
