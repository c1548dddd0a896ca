"""oneDNN int8 products streaming 40 distinct 1536 x 8960 weights from memory, by row count, for both weight layouts
(docs/int8.md, *The int8 kernel*):

    python docs/results/2026-11-24e/int8_layout.py
"""

import time

import torch

torch.manual_seed(0)
OUT_IN = [torch.randint(-127, 128, (8960, 1536), dtype=torch.int8) for _ in range(40)]  # passed transposed
IN_OUT = [torch.randint(-127, 128, (1536, 8960), dtype=torch.int8) for _ in range(40)]


def ms_per_product(rows: int, weights: list[torch.Tensor], transpose: bool) -> float:
    a = torch.randint(-127, 128, (rows, 1536), dtype=torch.int8)
    for w in weights[:4]:
        torch._int_mm(a, w.T if transpose else w)
    started = time.perf_counter()
    for w in weights:
        torch._int_mm(a, w.T if transpose else w)
    return (time.perf_counter() - started) / len(weights) * 1e3


for rows in (1, 2, 8, 16, 32, 48, 64):
    for name, weights, transpose in (("[out, in]^T", OUT_IN, True), ("[in, out]", IN_OUT, False)):
        ms = ms_per_product(rows, weights, transpose)
        print(f"{rows:3d} rows {name:12s} {ms:.3f} ms  {8960 * 1536 / ms / 1e6:.1f} GB/s")
