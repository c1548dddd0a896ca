#!/bin/bash
# Issue 35, 2026-11-26 (fourth stop): the KV cache at 2 bytes a value (the scale's bits in the parities of a token's
# first 32 integers), the attention's weighted sum in int32 vpdpwssd (keys in a zero-padded block, each kernel its
# own function), the MLP's SiLU computed in C where it is quantized. Against the main before this stop and the
# issue's day, then against OpenVINO GenAI. Idle machine, nothing else running. From the repository root, with git
# worktrees of the issue's day (81dd709) at /tmp/ab_issue, of the main before this stop (6252ed8) at /tmp/ab_before
# and of this code at /tmp/ab_final:
#   bash docs/results/2026-11-26e-cpu/run_all.sh
# The quality runs (quality.txt: the first 40 problems; quality_all.txt: all 164, each layout and float32) ran on
# their own, before and after it: quality_all.sh.
set -x
source .venv/bin/activate
R=docs/results/2026-11-26e-cpu
lscpu > $R/lscpu.txt
python -c "from batchspec.int8.native import packed_width; print('KV cache bytes per value, heads of 128:', 2 * packed_width(128) / 128)" > $R/kv_bytes.txt
for code in before final before final; do
    PYTHONPATH=/tmp/ab_$code/src python $R/attention_speed.py $code >> $R/attention_speed.txt
done
for code in before final before final; do
    for shape in "8 150" "1 1153"; do
        PYTHONPATH=/tmp/ab_$code/src python docs/results/2026-11-26c-cpu/prefill_parts.py $code $shape 2>/dev/null >> $R/prefill_parts.txt
    done
done
for code in before final before final; do
    PYTHONPATH=/tmp/ab_$code/src python docs/results/2026-11-26b-cpu/step_floor.py $code 2>/dev/null | tail -1 >> $R/step_floor.txt
done
# The bench's prompt reading (prefill_s), the issue's day's code against this code, on both prompt sets; 16 new
# tokens, since the reading is what is measured; this code with its prefix cache off, as the issue's day had none.
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 16 --batch-sizes 1,8 --methods autoregressive --no-compare)
SUMMARIES=(--prompts ../shared/data/spec_bench/question.jsonl --category summarization)
PYTHONPATH=/tmp/ab_issue/src python -m batchspec bench "${BENCH[@]}" -o $R/prefill_issue_humaneval
PYTHONPATH=/tmp/ab_final/src python -m batchspec bench "${BENCH[@]}" --prefix-cache-size 0 -o $R/prefill_humaneval
PYTHONPATH=/tmp/ab_issue/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" -o $R/prefill_issue_summaries
PYTHONPATH=/tmp/ab_final/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" --prefix-cache-size 0 \
    -o $R/prefill_summaries
python docs/results/2026-11-26c-cpu/prefill_table.py $R > $R/prefill.txt
# Against OpenVINO GenAI, both prefix caches off, as at the last stops (docs/results/2026-11-26b-cpu/run_all.sh)
BENCH=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1,8 --methods autoregressive,eqspec
       --proposers ngram,hybrid --prefix-cache-size 0)
PYTHONPATH=/tmp/ab_final/src python -m batchspec bench "${BENCH[@]}" -o $R/bench64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 --out $R/openvino64_nocache.json
PYTHONPATH=/tmp/ab_final/src python -m batchspec bench "${BENCH[@]}" "${SUMMARIES[@]}" -o $R/summaries64_nocache
/work/ov-venv/bin/python scripts/openvino_compare.py "${SUMMARIES[@]}" --limit 8 --max-new-tokens 64 \
    --out $R/openvino_summaries64_nocache.json
