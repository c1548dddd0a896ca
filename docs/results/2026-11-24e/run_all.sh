#!/bin/bash
# Issue 26's measurements, in one run on an idle machine (nothing else running). From the repository root:
#   bash docs/results/2026-11-24e/run_all.sh
set -x
R=docs/results/2026-11-24e
B="python -m batchspec bench --preset qwen2.5-coder -n 8"
export PYTHONPATH=src
lscpu > $R/lscpu.txt
python $R/memory.py none > $R/memory_none.json
python $R/memory.py int8 > $R/memory_int8.json
$B --quantize int8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec --proposers draft,ngram,hybrid -o $R/bench64_int8
$B --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec,hf-generate,hf-prompt-lookup --proposers draft,ngram,hybrid -o $R/bench64_float32
python $R/quality.py --out $R/quality.json
$B --quantize int8 --max-new-tokens 256 --batch-sizes 1,8 --methods autoregressive,eqspec --proposers draft,ngram,hybrid -o $R/bench256_int8
$B --max-new-tokens 256 --batch-sizes 1,8 --methods hf-generate,hf-prompt-lookup,eqspec --proposers ngram,hybrid -o $R/bench256_float32
