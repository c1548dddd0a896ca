"""Issue 61: the int8 and int4 products of every native build this CPU runs, on the MLP's shapes (1536 -> 8960 and
8960 -> 1536), streaming 30 distinct weights (so each product reads its weight from memory, not cache), against the
host's read bandwidth (a 1 GiB float32 sum) measured beside each cell. Rows 1 (a plain decode step), 8 (a verification
of k + 1 = 8 tokens) and 64 (a prompt read). One JSON line per build, width and shape:

    PYTHONPATH=src python docs/results/2026-11-28-cpu/product_speed.py
"""

import json
import statistics
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


def timed(run, count: int) -> float:
    """Median seconds of one product over 3 passes through the `count` weights."""
    run(0)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for i in range(count):
            run(i)
        times.append((time.perf_counter() - started) / count)
    return statistics.median(times)


def cells(name: str, outputs: int, inner: int, nbytes: int, product) -> dict:
    row = {"build": native.isa(), "width": name, "shape": f"{inner}->{outputs}", "MB": round(nbytes / 1e6, 2)}
    for rows in (1, 8, 64):
        x = torch.randn(rows, inner, generator=generator)
        run = product(x)
        read = bandwidth()
        seconds = timed(run, COUNT)
        row[f"rows_{rows}"] = {"ms": round(1e3 * seconds, 3), "GB_per_s": round(nbytes / seconds / 1e9, 1),
                               "read_GB_per_s": round(read / 1e9, 1), "of_read": round(nbytes / seconds / read, 2),
                               "TOP_per_s": round(2 * outputs * inner * rows / seconds / 1e12, 3)}
    return row


def int8_product(weights, outputs):
    def product(x):
        codes, scale = native.quantize(x)
        col = torch.ones(outputs)
        return lambda i: native.linear(codes, *weights[i], scale, col)
    return product


def int4_product(weights, outputs, inner):
    def product(x):
        rows = native.quantize_blocks(x, int4.SUB_BLOCK * int4.SUBS)
        return lambda i: native.linear4(rows, weights[i], inner, int4.SUBS, outputs)
    return product


for outputs, inner in ((8960, 1536), (1536, 8960)):
    eight = [native.pack(torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator))
             for _ in range(COUNT)]
    four = [int4.from_float(torch.randn(outputs, inner, generator=generator)).packed() for _ in range(COUNT)]
    for isa in native.host_isas():
        with native.using(isa):
            print(json.dumps(cells("int8", outputs, inner, eight[0][0].numel(), int8_product(eight, outputs))),
                  flush=True)
            print(json.dumps(cells("int4", outputs, inner, four[0].numel(), int4_product(four, outputs, inner))),
                  flush=True)
