#!/usr/bin/env bash
# Set up .venv in the repository root (CPU PyTorch, batchspec with its test extras), then run a job.
#
#   bash scripts/setup.sh test    # ruff + the pytest suite
#   bash scripts/setup.sh env     # only set up .venv
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-test}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "batchspec needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check --quiet)
# torch first, pinned, so nothing later resolves a CUDA build
"${pip[@]}" install -c constraints/cpu.txt torch
"${pip[@]}" install -c constraints/cpu.txt -e ".[test]"

case "$job" in
    env) ;;
    test)
        .venv/bin/ruff check .
        .venv/bin/python -m pytest "${@:2}"
        ;;
    *)
        echo "unknown job '$job'; expected: test | env" >&2
        exit 2
        ;;
esac
