#!/bin/bash
# Issue 35 against OpenVINO GenAI with this stop's code, 8 HumanEval prompts, 64 new tokens, idle machine, each with
# its prefix cache off and on (batchspec's is on by default since issue 37; OpenVINO's LLMPipeline default is on, the
# earlier comparisons turned it off). From the repository root, in a git worktree of this commit at /tmp/ab_after:
#   bash docs/results/2026-11-26-cpu/run_openvino_prefix.sh
set -x
R=docs/results/2026-11-26-cpu
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid)
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" --prefix-cache-size 0 -o $R/final_bench64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/final_openvino64_nocache.json
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" -o $R/final_bench64_cache
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --prefix-caching \
    --out $R/final_openvino64_cache.json
