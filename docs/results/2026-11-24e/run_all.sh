#!/bin/bash
# Issue 26's measurements, one after another on an idle machine (nothing else running). From the repository root:
#   bash docs/results/2026-11-24e/run_all.sh
# (The first pass of this session also wrote quality_first.json and bench64_int8_first/ with the code before the
# attention's float32 softmax stage and the packed KV cache; `memory_*.json` and `bench64_float32/` are from it.)
set -x
R=docs/results/2026-11-24e
B="python -m batchspec bench --preset qwen2.5-coder -n 8"
export PYTHONPATH=src
lscpu > $R/lscpu.txt
# python $R/memory.py none > $R/memory_none.json; python $R/memory.py int8 > $R/memory_int8.json
# $B --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec,hf-generate,hf-prompt-lookup \
#    --proposers draft,ngram,hybrid -o $R/bench64_float32
$B --quantize int8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec --proposers draft,ngram,hybrid -o $R/bench64_int8
python $R/quality.py --reuse-float32 $R/quality_first.json --out $R/quality.json
python -m batchspec audit --preset qwen2.5-coder -n 8 --quantize int8 --max-new-tokens 64 --batch-sizes 1,8 --proposers ngram,hybrid -o $R/audit64_int8
$B --quantize int8 --max-new-tokens 256 --batch-sizes 1,8 --methods autoregressive,eqspec --proposers draft,ngram,hybrid -o $R/bench256_int8
$B --max-new-tokens 256 --batch-sizes 1,8 --methods hf-generate,hf-prompt-lookup,eqspec --proposers ngram,hybrid -o $R/bench256_float32
