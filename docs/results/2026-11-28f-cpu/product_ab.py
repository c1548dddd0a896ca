"""Issue 61, sixth stop: the int8 and int4 products of one build on the MLP's shapes (1536 -> 8960, 8960 -> 1536),
streaming 30 distinct weights (each product reads its weight from memory), against the read bandwidth (a 1 GiB float32
sum) measured just before each cell. Rows 1 (a plain decode step), 8 (a verification) and 64 (a prompt read). One JSON
line: per cell (ms, share of the read bandwidth, GB/s of that read). Run under the tree to measure:

    PYTHONPATH=src python docs/results/2026-11-28f-cpu/product_ab.py avx2 after
"""

import json
import statistics
import sys
import time

import torch

from batchspec.exact.integer import int4, native

torch.set_num_threads(2)
COUNT = 30
generator = torch.Generator().manual_seed(0)
block = torch.ones((1 << 30) // 4)


def bandwidth() -> float:
    started = time.perf_counter()
    block.sum()
    return (1 << 30) / (time.perf_counter() - started)


def timed(run) -> float:
    """Median seconds of one product over 3 passes through the COUNT weights."""
    run(0)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for i in range(COUNT):
            run(i)
        times.append((time.perf_counter() - started) / COUNT)
    return statistics.median(times)


def cells(outputs: int, inner: int) -> dict:
    eight = [native.pack(torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator))
             for _ in range(COUNT)]
    four = [int4.from_float(torch.randn(outputs, inner, generator=generator)).packed() for _ in range(COUNT)]
    row = {}
    for rows in (1, 8, 64):
        x = torch.randn(rows, inner, generator=generator)
        codes, scale = native.quantize(x)
        blocked = native.quantize_blocks(x, int4.SUB_BLOCK * int4.SUBS)
        ones = torch.ones(outputs)
        runs = {"int8": (lambda i, c=codes, s=scale, o=ones: native.linear(c, *eight[i], s, o), eight[0][0].numel()),
                "int4": (lambda i, b=blocked: native.linear4(b, four[i], inner, int4.SUBS, outputs),
                         four[0].numel())}
        for width, (run, nbytes) in runs.items():
            read = bandwidth()
            seconds = timed(run)
            row[f"{width} {inner}->{outputs} rows {rows}"] = (round(1e3 * seconds, 3),
                                                              round(nbytes / seconds / read, 2), round(read / 1e9, 1))
    return row


isa, code = sys.argv[1], sys.argv[2]
with native.using(isa):
    result = {"code": code, "build": isa}
    for shape in ((8960, 1536), (1536, 8960)):
        result.update(cells(*shape))
print(json.dumps(result), flush=True)
