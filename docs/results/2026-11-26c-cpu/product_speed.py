"""Issue 35: TOP/s of the int8 product (``native.linear``) at a prompt reading's shapes (the 1.5B target's four
weights, 240 and 1200 rows), the best of 5 after one discarded, with freed memory kept for reuse as the commands keep
it. One process per code, alternated (``run_all.sh``):

    PYTHONPATH=/tmp/ab_after/src python docs/results/2026-11-26c-cpu/product_speed.py after
"""
import sys
import time

import torch

from batchspec.int8 import native
from batchspec.memory import keep_freed_memory

keep_freed_memory()
torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
for rows in (240, 1200):
    for inner, outputs, name in ((1536, 2048, "q/k/v"), (1536, 1536, "o"), (1536, 17920, "gate/up"),
                                 (8960, 1536, "down")):
        panels, sums = native.pack(torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator))
        codes = native.codes(torch.randint(-127, 128, (rows, inner), generator=generator).float())
        row_scale, col_scale = torch.ones(rows, 1), torch.ones(outputs)
        seconds = []
        for _ in range(6):
            started = time.perf_counter()
            native.linear(codes, panels, sums, row_scale, col_scale)
            seconds.append(time.perf_counter() - started)
        best = min(seconds[1:])
        print(f"{sys.argv[1]}: {name:7s} {rows:5d} x {inner} -> {outputs:5d}: {best * 1e3:7.1f} ms, "
              f"{2 * rows * inner * outputs / best / 1e12:.3f} TOP/s")
