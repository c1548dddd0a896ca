#!/bin/bash
# Issue 26's measurements, one after another on an idle machine (nothing else running). From the repository root:
#   bash docs/results/2026-11-24e/run_all.sh
# The figures in the README come from three passes of this session over changing int8 code, each on an idle
# machine: float32 (bench64_float32/, bench256_float32_b8/, bench256_float32_b1/, memory_none.json and the float32
# half of quality_first.json) does not depend on that code; int8's final figures are bench64_int8/, bench256_int8/,
# memory_int8.json and quality.json (smoothing, float32 answers reused from quality_first.json). Earlier int8
# passes are kept as *_first, *_second and quality_unsmoothed.json.
set -x
R=docs/results/2026-11-24e
B="python -m batchspec bench --preset qwen2.5-coder -n 8"
export PYTHONPATH=src
lscpu > $R/lscpu.txt
python $R/memory.py none > $R/memory_none.json
python $R/memory.py int8 > $R/memory_int8.json
$B --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec,hf-generate,hf-prompt-lookup \
    --proposers draft,ngram,hybrid -o $R/bench64_float32
$B --max-new-tokens 256 --proposers ngram,hybrid --batch-sizes 8 --methods hf-generate,eqspec -o $R/bench256_float32_b8
mkdir -p $R/bench256_float32_b1 && cp $R/bench256_float32_b8/reference.json $R/bench256_float32_b1/
$B --max-new-tokens 256 --proposers ngram,hybrid --batch-sizes 1 --methods hf-prompt-lookup,eqspec -o $R/bench256_float32_b1
python $R/quality.py --out $R/quality_first.json
python $R/quality.py --reuse-float32 $R/quality_first.json --out $R/quality.json
$B --quantize int8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec,exspec \
    --proposers draft,ngram,hybrid -o $R/bench64_int8
python -m batchspec audit --preset qwen2.5-coder -n 8 --quantize int8 --max-new-tokens 64 --batch-sizes 1,8 \
    --proposers ngram,hybrid -o $R/audit64_int8
$B --quantize int8 --max-new-tokens 256 --batch-sizes 1,8 --methods autoregressive,eqspec \
    --proposers draft,ngram,hybrid -o $R/bench256_int8
