"""The int8 product kernels against each other (issue 35), ms or us per product; output in ``kernels.txt``.

    PYTHONPATH=src python docs/results/2026-11-25b-cpu/kernels.py streaming   # 1536 x 8960 etc., GB/s
    PYTHONPATH=src python docs/results/2026-11-25b-cpu/kernels.py sizes       # the presets' shapes, us

Each product streams ``n`` distinct int8 weights from memory, as a forward does (best of several passes):
``torch._int_mm`` on ``[K, O]``, on ``[O, K]`` transposed, and oneDNN's quantized linear on prepacked weights with
uint8 activations (zero point 128, unit scales).
"""

from __future__ import annotations

import sys
import time

import torch


def _best(product, weights, activations, passes: int) -> float:
    for weight in weights:
        product(activations, weight)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for weight in weights:
            product(activations, weight)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best


def measure(inner: int, outer: int, rows: int, count: int, passes: int) -> dict[str, float]:
    """Seconds per product of each kernel for ``rows`` activations and ``count`` distinct ``[outer, inner]`` weights."""
    weights = [torch.randint(-127, 128, (outer, inner), dtype=torch.int8) for _ in range(count)]
    ones, zeros = torch.ones(outer), torch.zeros(outer, dtype=torch.long)
    packed = [torch.ops.onednn.qlinear_prepack(w, None) for w in weights]
    a = torch.randint(-127, 128, (rows, inner), dtype=torch.int8)
    codes = (a.to(torch.int16) + 128).to(torch.uint8)

    def onednn(x, w):
        unit = (1.0, 128, w, ones, zeros, None, 1.0, 0, torch.float32)
        return torch.ops.onednn.qlinear_pointwise(x, *unit, "none", [], "")

    return {
        "int_mm [K,O]": _best(torch._int_mm, [w.T.contiguous() for w in weights], a, passes),
        "int_mm [O,K]T": _best(lambda x, w: torch._int_mm(x, w.T), weights, a, passes),
        "onednn prepacked": _best(onednn, packed, codes, passes),
    }


def main(part: str) -> None:
    torch.manual_seed(0)
    if part == "streaming":
        for inner, outer, count in ((1536, 8960, 30), (576, 1536, 150), (8960, 1536, 30), (1536, 256, 200)):
            for rows in (1, 8, 48, 256):
                times = measure(inner, outer, rows, count, passes=3)
                rates = ", ".join(f"{k} {inner * outer / t / 1e9:.1f} GB/s" for k, t in times.items())
                print(f"{inner}x{outer} rows={rows}: {rates}", flush=True)
    else:
        shapes = ((576, 576), (576, 192), (576, 1536), (1536, 576), (896, 896), (896, 128), (896, 4864),
                  (4864, 896), (1536, 1536), (1536, 256), (576, 49152), (1536, 151936))
        for inner, outer in shapes:
            count = max(2, min(60, (1 << 28) // (inner * outer)))
            times = measure(inner, outer, 1, count, passes=5)
            print(f"{inner}x{outer} rows=1: " + ", ".join(f"{k} {t * 1e6:.1f} us" for k, t in times.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "streaming")
