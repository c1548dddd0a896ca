#!/bin/bash
# Issue 61, 2026-11-28 (fifth stop): the bench's plain B = 1 cell (8 HumanEval prompts x 64 new tokens), this main and
# the one before it (checked out at $BEFORE: git worktree add $BEFORE 64850c4) alternated twice, each build and
# width, one process each; the JSON lines (tokens/s, the decode steps' seconds) go to ab_plain.jsonl.
#   BEFORE=/tmp/before bash docs/results/2026-11-28e-cpu/ab_plain.sh
source .venv/bin/activate
R=$PWD/docs/results/2026-11-28e-cpu
ARGS=(--preset qwen2.5-coder -n 8 --max-new-tokens 64 --batch-sizes 1 --methods autoregressive --prefix-cache-size 0)
for round in 1 2; do
    for isa_quantize in avx512vnni:int4 avx512vnni:int8 avx2:int4; do
        isa=${isa_quantize%:*} quantize=${isa_quantize#*:}
        for code in before after; do
            dir=$PWD; [ $code = before ] && dir=$BEFORE
            (cd "$dir" && BATCHSPEC_CPU_ISA=$isa PYTHONPATH=src python -m batchspec bench "${ARGS[@]}" \
                --quantize $quantize -o /tmp/ab_plain_out >/dev/null 2>&1)
            python -c "import json,sys; r=json.load(open('/tmp/ab_plain_out/results.json'))[0]; print(json.dumps(dict(
code='$code', isa='$isa', quantize='$quantize', round=$round, tokens_per_s=round(r['tokens_per_s'], 2),
decode_s=round(r['verify_s'], 2), prefill_s=round(r['prefill_s'], 2))))" >> $R/ab_plain.jsonl
        done
    done
done
