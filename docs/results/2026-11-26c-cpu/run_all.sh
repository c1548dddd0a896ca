#!/bin/bash
# Issue 35, 2026-11-26 (third stop), commit 27fdf13, the first of this stop's two runs: the code with the 2-byte KV
# cache, which did not land (its pass@1 below; docs/results/2026-11-26d-cpu/ is the landed code's run). Stopped
# after OpenVINO's HumanEval cells, so the summarization comparison at the end is not here. The product benchmark
# was first named kernels.py, which transformers imports as the `kernels` package when the script's folder is on
# sys.path: the prefill_parts.py and step_floor.py processes ran it once before loading the model (its lines are
# removed from prefill_parts.txt).
# The product's six-row micro-kernel, vectorized quantization (and the MLP's
# product quantized without being written), the 2-byte KV cache, the attention's key and value blocks; against the
# main before this stop and against the issue's day. Idle machine, nothing else running. From the repository root,
# with git worktrees of the issue's day (81dd709) at /tmp/ab_issue, of the main before this stop (e6d3c0f) at
# /tmp/ab_before and of this code at /tmp/ab_after:
#   bash docs/results/2026-11-26c-cpu/run_all.sh
set -x
source .venv/bin/activate
R=docs/results/2026-11-26c-cpu
lscpu > $R/lscpu.txt
gcc -O3 -mavx512f -mavx512bw -mavx512vnni -fopenmp $R/vpdpbusd_peak.c -o /tmp/vpdpbusd_peak
/tmp/vpdpbusd_peak > $R/vpdpbusd_peak.txt
for code in before after before after; do
    PYTHONPATH=/tmp/ab_$code/src python $R/product_speed.py $code >> $R/product_speed.txt
done
for code in before after before after; do
    for shape in "8 150" "1 1153"; do
        PYTHONPATH=/tmp/ab_$code/src python $R/prefill_parts.py $code $shape 2>/dev/null >> $R/prefill_parts.txt
    done
done
for code in before after before after; do
    PYTHONPATH=/tmp/ab_$code/src python docs/results/2026-11-26b-cpu/step_floor.py $code 2>/dev/null | tail -1 >> $R/step_floor.txt
done
# The bench's prompt reading (prefill_s), the issue's day's code against this code, on both prompt sets; 16 new
# tokens, since the reading is what is measured; this code with its prefix cache off, as the issue's day had none.
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 16 --batch-sizes 1,8 --methods autoregressive --no-compare)
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
PYTHONPATH=/tmp/ab_issue/src python -m batchspec bench "${BENCH[@]}" -o $R/prefill_issue_humaneval
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" --prefix-cache-size 0 -o $R/prefill_humaneval
PYTHONPATH=/tmp/ab_issue/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" -o $R/prefill_issue_summaries
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" --prefix-cache-size 0 \
    -o $R/prefill_summaries
python $R/prefill_table.py > $R/prefill.txt
# Quality of the 2-byte KV cache: pass@1 on the first 40 HumanEval problems, float32's answers reused
PYTHONPATH=/tmp/ab_after/src python docs/results/2026-11-24e/quality.py \
    --reuse-float32 docs/results/2026-11-24e/quality_first.json --out $R/quality.json > $R/quality.txt
# Against OpenVINO GenAI, both prefix caches off, as at the last stop (docs/results/2026-11-26b-cpu/run_all.sh)
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" -o $R/bench64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64_nocache.json
PYTHONPATH=/tmp/ab_after/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" -o $R/summaries64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/openvino_summaries64_nocache.json
