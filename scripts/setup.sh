#!/usr/bin/env bash
# Set up .venv in the repository root (CPU PyTorch, batchspec with its test, ray and load-test extras), then run a job.
#
#   bash scripts/setup.sh demo    # obtain the default preset, generate code for 4 HumanEval problems
#   bash scripts/setup.sh test    # ruff, obtain the smollm2 preset, the pytest suite
#   bash scripts/setup.sh env     # only set up .venv
#
# Extra arguments go to `batchspec generate` (demo) or to pytest (test). Presets are cached in
# $BATCHSPEC_CACHE (default ~/.cache/batchspec); only the first run downloads and converts them.
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-test}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "batchspec needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
# --no-compile: pip byte-compiles none of the packages (torch, triton and ray hold tens of thousands of modules: 67 s
# instead of 116-125 s for the whole install on a Zen 5); Python compiles the modules it imports, once (the demo's
# first load then took 64.5 s against 53.8 s for its second)
pip=(.venv/bin/python -m pip --disable-pip-version-check --quiet)
# ... and so that "once" holds where PYTHONDONTWRITEBYTECODE is set (CI hosts set it): without it every process
# compiled every module it imported again, 13 s of the 24 s pytest took to collect the suite on a Zen 4, again in
# each of its two workers and in each Python process a test starts (servers, the CLI, Ray's workers)
unset PYTHONDONTWRITEBYTECODE
# torch first, pinned, so nothing later resolves a CUDA build
"${pip[@]}" install --no-compile -c constraints/cpu.txt torch
"${pip[@]}" install --no-compile -c constraints/cpu.txt -e ".[test,ray,load]"

case "$job" in
    env) ;;
    demo)
        .venv/bin/batchspec fetch
        .venv/bin/batchspec generate --prompts humaneval --limit 4 --batch-size 4 --max-new-tokens 256 "${@:2}"
        ;;
    test)
        .venv/bin/ruff check .
        .venv/bin/batchspec fetch --preset smollm2
        .venv/bin/batchspec fetch --preset gemma3
        # two workers, a file each at a time, one torch thread each (tests/conftest.py): 4.5 instead of 6.2 minutes
        .venv/bin/python -m pytest -n 2 --dist loadfile "${@:2}"
        ;;
    *)
        echo "unknown job '$job'; expected: demo | test | env" >&2
        exit 2
        ;;
esac
