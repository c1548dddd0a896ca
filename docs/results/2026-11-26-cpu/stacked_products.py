"""Issue 35: the 1.5B target's 28 layers of products at 1 and 8 rows, as seven products per layer (q, k, v, o, gate,
up, down) and as four (qkv, o, gate+up, down: int8/linear.py's stacked layers), alternated, random int8 weights.

    python docs/results/2026-11-26-cpu/stacked_products.py
"""

import statistics
import time

import torch

from batchspec.int8 import native

LAYERS = 28
SEPARATE = ((1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960))
STACKED = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))


def packed(outputs: int, inner: int) -> tuple:
    weight = torch.randint(-127, 128, (outputs, inner), dtype=torch.int8)
    panels, sums = native.pack(weight)
    return panels, sums, torch.rand(outputs) + 0.5, inner


def run(layers: list, rows: int) -> float:
    codes = {k: torch.full((rows, k), 128, dtype=torch.uint8) for k in (1536, 8960)}  # [N, K] each
    scale = torch.ones(rows, 1)
    started = time.perf_counter()
    for layer in layers:
        for panels, sums, columns, inner in layer:
            native.linear(codes[inner], panels, sums, scale, columns)
    return time.perf_counter() - started


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    separate = [[packed(*shape) for shape in SEPARATE] for _ in range(LAYERS)]
    stacked = [[packed(*shape) for shape in STACKED] for _ in range(LAYERS)]
    for rows in (1, 8):
        a, b = [], []
        for _ in range(7):
            a.append(run(separate, rows))
            b.append(run(stacked, rows))
        ratio = statistics.median([y / x for x, y in zip(a, b, strict=True)])
        print(f"N={rows}  28 layers' products: separate {1e3 * statistics.median(a):.1f} ms (196 calls against 112), "
              f"fused {1e3 * statistics.median(b):.1f} ms; ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
