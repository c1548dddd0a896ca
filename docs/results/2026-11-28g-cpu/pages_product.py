"""Issue 61, seventh stop: one row's int4 and int8 products (the MLP's 1536 -> 8960), 30 distinct weights streamed,
each held once in ordinary memory (4 KiB pages) and once in a weight_buffer (2 MiB pages), alternated for `seconds`
with the read bandwidth (a 1 GiB float32 sum) measured before each pass; the median share of that bandwidth per
bandwidth level (below / above 42 GB/s) and memory. One JSON line:

    PYTHONPATH=src python docs/results/2026-11-28g-cpu/pages_product.py 120
"""

import json
import statistics
import sys
import time

import torch

from batchspec.exact.integer import int4, native
from batchspec.memory import weight_buffer

torch.set_num_threads(2)
COUNT, OUTPUTS, INNER = 30, 8960, 1536
generator = torch.Generator().manual_seed(0)
block = torch.ones((1 << 30) // 4)


def bandwidth() -> float:
    started = time.perf_counter()
    block.sum()
    return (1 << 30) / (time.perf_counter() - started)


def small_pages(t: torch.Tensor) -> torch.Tensor:
    return t.clone()  # torch.empty's memory: 4 KiB pages (transparent huge pages on madvise only)


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    return weight_buffer(tuple(t.shape), t.dtype).copy_(t)


x = torch.randn(1, INNER, generator=generator)
codes, scale = native.quantize(x)
blocked = native.quantize_blocks(x, int4.SUB_BLOCK * int4.SUBS)
ones = torch.ones(OUTPUTS)
fours = [int4.from_float(torch.randn(OUTPUTS, INNER, generator=generator)).packed() for _ in range(COUNT)]
eights = [native.pack(torch.randint(-127, 128, (OUTPUTS, INNER), dtype=torch.int8, generator=generator))
          for _ in range(COUNT)]
runs = {}
for pages, hold in (("4k", small_pages), ("2m", huge_pages)):
    four = [hold(w) for w in fours]
    eight = [(hold(p), s) for p, s in eights]
    runs[f"int4 {pages}"] = (lambda w=four: [native.linear4(blocked, p, INNER, int4.SUBS, OUTPUTS) for p in w],
                             fours[0].numel())
    runs[f"int8 {pages}"] = (lambda w=eight: [native.linear(codes, p, s, scale, ones) for p, s in w],
                             eights[0][0].numel())
shares = {name: [] for name in runs}
end = time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    for name, (run, nbytes) in runs.items():
        read = bandwidth()
        started = time.perf_counter()
        run()
        shares[name].append((read / 1e9, nbytes * COUNT / (time.perf_counter() - started) / read))
result = {"build": native.isa()}
for name, values in shares.items():
    for level, low, high in (("low", 0, 42), ("high", 42, 1000)):
        chosen = [v for v in values if low <= v[0] < high]
        if chosen:
            result[f"{name} {level}"] = {"passes": len(chosen),
                                         "gb_s": round(statistics.median(v[0] for v in chosen), 1),
                                         "share": round(statistics.median(v[1] for v in chosen), 3)}
print(json.dumps(result), flush=True)
