"""Issue 53: the tables of this run (run_all.sh's outputs in this folder): tokens/s of 8 HumanEval prompts x 64 new
tokens per build against OpenVINO GenAI and float32, the prompt reading against float32, the demo's summaries.

    python docs/results/2026-11-27-cpu/tables.py > docs/results/2026-11-27-cpu/tables.txt
"""
import json
import re
from pathlib import Path

here = Path(__file__).parent


def bench(name: str) -> dict[tuple[str, int], float]:
    """``(cell, B) -> tokens/s``: ``plain`` for autoregressive, ``eqspec ngram`` and the like."""
    out = {}
    for c in json.loads((here / name / "results.json").read_text()):
        cell = "plain" if c["method"] == "autoregressive" else f"{c['method']} {c['proposer']}"
        out[cell, c["batch_size"]] = c["tokens_per_s"]
    return out


def openvino(name: str) -> dict[tuple[str, int], float]:
    cells = json.loads((here / name).read_text())["cells"]
    return {(c["method"], c["batch_size"]): c["tokens_per_s"] for c in cells if "tokens_per_s" in c}


def best(cells: dict[tuple[str, int], float], size: int) -> tuple[str, float]:
    return max(((cell, v) for (cell, b), v in cells.items() if b == size), key=lambda item: item[1])


runs = {"batchspec avx2": bench("bench64_avx2"), "batchspec avx512vnni": bench("bench64_avx512vnni"),
        "batchspec float32 (AVX2-capped)": bench("bench64_float32_avx2"),
        "OpenVINO GenAI (defaults)": openvino("openvino64.json"),
        "OpenVINO GenAI (capped at AVX2)": openvino("openvino64_avx2cap.json")}
print("8 HumanEval x 64 new tokens, tokens/s (prompts read and answers generated)")
print("| run | plain B=1 | best B=1 | plain B=8 | best B=8 |")
print("| --- | --- | --- | --- | --- |")
for name, cells in runs.items():
    b1, b8 = best(cells, 1), best(cells, 8)
    print(f"| {name} | {cells['plain', 1]:.2f} | {b1[1]:.2f} ({b1[0]}) | {cells['plain', 8]:.2f} | "
          f"{b8[1]:.2f} ({b8[0]}) |")
ours = runs["batchspec avx2"]
for other in ("OpenVINO GenAI (defaults)", "OpenVINO GenAI (capped at AVX2)", "batchspec float32 (AVX2-capped)"):
    theirs = runs[other]
    ratios = [best(ours, b)[1] / best(theirs, b)[1] for b in (1, 8)]
    print(f"avx2 / {other}: plain B=1 {ours['plain', 1] / theirs['plain', 1]:.2f}x, "
          f"best B=1 {ratios[0]:.2f}x, best B=8 {ratios[1]:.2f}x")
print()
for b in (1, 8):
    reads = {}
    for name in ("prefill_avx2", "prefill_float32_avx2"):
        cell = next(c for c in json.loads((here / name / "results.json").read_text()) if c["batch_size"] == b)
        reads[name] = cell["prefill_s"]
    print(f"prompt reading, B = {b}: int8 avx2 {reads['prefill_avx2']:.2f} s, float32 AVX2-capped "
          f"{reads['prefill_float32_avx2']:.2f} s: {reads['prefill_float32_avx2'] / reads['prefill_avx2']:.2f}x")
print()
for name in ("demo_avx2.txt", "demo_avx512vnni.txt"):
    text = (here / name).read_text() if (here / name).exists() else ""
    lines = [line for line in text.splitlines() if re.search(r"tokens/s|tok/s", line)]
    print(name, lines[-3:])
