"""Issue 61, seventh stop: the read bandwidth (a 1 GiB float32 sum, 2 threads) from ordinary memory (4 KiB pages)
and from a weight_buffer (2 MiB pages), alternated for `seconds`; medians per bandwidth level of the first. One JSON
line:

    PYTHONPATH=src python docs/results/2026-11-28g-cpu/pages_read.py 60
"""

import json
import statistics
import sys
import time

import torch

from batchspec.memory import weight_buffer

torch.set_num_threads(2)
small = torch.ones((1 << 30) // 4)
huge = weight_buffer(((1 << 30) // 4,), torch.float32).fill_(1.0)


def bandwidth(block: torch.Tensor) -> float:
    started = time.perf_counter()
    block.sum()
    return (1 << 30) / (time.perf_counter() - started) / 1e9


pairs = []
end = time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    pairs.append((bandwidth(small), bandwidth(huge)))
result = {}
for level, low, high in (("low", 0, 42), ("high", 42, 1000)):
    chosen = [p for p in pairs if low <= p[0] < high]
    if chosen:
        result[level] = {"reads": len(chosen), "4k_gb_s": round(statistics.median(p[0] for p in chosen), 1),
                         "2m_gb_s": round(statistics.median(p[1] for p in chosen), 1),
                         "2m_over_4k": round(statistics.median(p[1] / p[0] for p in chosen), 3)}
print(json.dumps(result), flush=True)
