#!/bin/bash
# The README's Results, every scenario in one command: each writes JSON (and markdown) under one folder, with the
# machine's lscpu, the date and the commit, and summary.md gathers their tables. Run it alone on an idle machine
# (SpecBench and the server run one plain/default pair per cell, so that the whole fits in an hour on 2 cores; pass
# REPEATS=2 for A B B A pairs, about twice as long); nothing else may run beside it, since the host's speed is part of
# every figure. Peers that are not installed are named in summary.md and skipped.
#
#   bash scripts/results.sh runs/results                      # every scenario
#   bash scripts/results.sh runs/results specbench,memory     # some of them
#   DRY_RUN=1 bash scripts/results.sh runs/results            # print the commands only
#
# Scenarios: quickstart (the Quick start's demo under /usr/bin/time -v), humaneval (8 problems x 64 tokens, plain and
# the default at B = 1 and 8, int4 and int8; OpenVINO GenAI's int4 export beside them where scripts/openvino_setup.sh
# has made .ov-venv), specbench (scripts/specbench.py: seven categories at B = 1, 4, 8), serve
# (scripts/specbench_serve.py: 1, 4, 8, 16 clients), memory (/usr/bin/time -v of one generate per width), floor (the
# one-token step against the measured read bandwidth: batchspec costs). SpecBench's prompts are read from
# ../shared/data/spec_bench/question.jsonl, or $SPECBENCH_QUESTIONS.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${1:?usage: bash scripts/results.sh OUT_DIR [scenario,scenario...]}"
all=quickstart,humaneval,specbench,serve,memory,floor
wanted=",${2:-$all},"
questions="${SPECBENCH_QUESTIONS:-../shared/data/spec_bench/question.jsonl}"
bin=.venv/bin
repeats="${REPEATS:-1}"
failed=()

run() {  # run NAME COMMAND...: the command's output to OUT/NAME.log; a failure is recorded, the others still run
    local name="$1"; shift
    echo "+ $*" | tee -a "$out/commands.txt"
    [ -n "${DRY_RUN:-}" ] && return 0
    "$@" > "$out/$name.log" 2>&1 || failed+=("$name")
}
want() { [[ "$wanted" == *",$1,"* ]]; }

mkdir -p "$out"
: > "$out/commands.txt"
if [ -z "${DRY_RUN:-}" ]; then
    lscpu > "$out/lscpu.txt"
    { date -u; git rev-parse HEAD; } > "$out/when.txt"
fi

if want quickstart; then
    run quickstart /usr/bin/time -v bash scripts/setup.sh demo
fi
if want humaneval; then
    for width in int4 int8; do
        run "humaneval_$width" "$bin/batchspec" bench --preset qwen2.5-coder -n 8 --max-new-tokens 64 \
            --batch-sizes 1,8 --methods autoregressive,eqspec --proposers ngram,hybrid --quantize "$width" \
            -o "$out/humaneval_$width"
    done
    if [ -x .ov-venv/bin/python ]; then
        run openvino .ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 \
            --weight-format int4 --out "$out/openvino_int4.json"
    else
        echo "openvino: not installed (bash scripts/openvino_setup.sh makes .ov-venv)" >> "$out/peers.txt"
    fi
fi
if want specbench; then
    run specbench "$bin/python" scripts/specbench.py --output "$out/specbench" --questions "$questions" \
        --repeats "$repeats" -- \
        --quantize int8
fi
if want serve; then
    run serve "$bin/python" scripts/specbench_serve.py --output "$out/serve" --repeats "$repeats" \
        -- --quantize int8
fi
if want memory; then
    for width in int8 int4; do
        run "memory_$width" /usr/bin/time -v "$bin/batchspec" generate --prompts humaneval --limit 8 --batch-size 8 \
            --max-new-tokens 64 --quantize "$width" --output "$out/memory_$width.jsonl"
    done
fi
if want floor; then
    run floor "$bin/batchspec" costs --context 200 --batch-sizes 1,4,8 --draft-lengths 3 -o "$out/floor"
fi
[ -n "${DRY_RUN:-}" ] && exit 0

{
    echo "# Results, $(head -1 "$out/when.txt"), commit $(sed -n 2p "$out/when.txt")"
    echo
    grep -m1 "Model name" "$out/lscpu.txt"
    [ -f "$out/peers.txt" ] && { echo; cat "$out/peers.txt"; }
    for log in "$out"/quickstart.log "$out"/memory_*.log; do
        [ -f "$log" ] || continue
        echo; echo "## $(basename "$log" .log)"; echo
        grep -E "tokens .* tokens/s|Loaded|Maximum resident" "$log" | sed 's/^\s*/    /'
    done
    for table in "$out"/humaneval_*/results.md "$out"/specbench/specbench.md "$out"/serve/serve.md; do
        [ -f "$table" ] && { echo; echo "## ${table#"$out"/}"; echo; cat "$table"; }
    done
    [ -f "$out/openvino_int4.json" ] && { echo; echo "## openvino_int4.json"; echo; cat "$out/openvino_int4.json"; }
    [ -f "$out/floor.log" ] && { echo; echo "## floor"; echo; sed 's/^/    /' "$out/floor.log"; }
    [ ${#failed[@]} -gt 0 ] && { echo; echo "Failed: ${failed[*]} (see their .log)"; }
} > "$out/summary.md"
echo "wrote $out/summary.md"
[ ${#failed[@]} -eq 0 ]
