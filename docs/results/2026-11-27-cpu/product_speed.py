"""Issue 53: the int8 product of every native build this CPU runs, and float32's, on the MLP's 1536 x 8960 shape,
streaming 30 distinct weights (411 MB in int8, so each product reads its weight from memory, not cache), against
the host's read bandwidth (a 1 GiB float32 sum) measured in the same process. Rows 1 (a plain decode step), 8 (a
verification of k + 1 = 8 tokens) and 64 (a prompt read). One JSON line per build:

    python docs/results/2026-11-27-cpu/product_speed.py            # every native build
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python docs/results/2026-11-27-cpu/product_speed.py float32  # float32 capped at AVX2
"""

import json
import statistics
import sys
import time

import torch

from batchspec.int8 import native

torch.set_num_threads(2)
OUT, IN, COUNT = 8960, 1536, 30
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


def int8_builds() -> list[dict]:
    weights = [native.pack(torch.randint(-127, 128, (OUT, IN), dtype=torch.int8, generator=generator))
               for _ in range(COUNT)]
    out = []
    for isa in native.host_isas():
        with native.using(isa):
            row = {"build": isa}
            for rows in (1, 8, 64):
                codes = native.codes(torch.randint(-127, 128, (rows, IN), generator=generator).float())
                scale, col = torch.ones(rows, 1), torch.ones(OUT)
                read = bandwidth()
                seconds = timed(lambda i, c=codes, s=scale, o=col: native.linear(c, *weights[i], s, o), COUNT)
                row[f"rows_{rows}"] = {"ms": round(1e3 * seconds, 3), "GB_per_s": round(OUT * IN / seconds / 1e9, 1),
                                       "read_GB_per_s": round(read / 1e9, 1),
                                       "of_read": round(OUT * IN / seconds / read, 2),
                                       "TOP_per_s": round(2 * OUT * IN * rows / seconds / 1e12, 3)}
            out.append(row)
    return out


def float32() -> list[dict]:
    weights = [torch.randn(OUT, IN, generator=generator) for _ in range(8)]  # 440 MB
    row = {"build": f"float32 ({torch.backends.cpu.get_cpu_capability()})"}
    for rows in (1, 8, 64):
        x = torch.randn(rows, IN, generator=generator)
        read = bandwidth()
        seconds = timed(lambda i, x=x: torch.nn.functional.linear(x, weights[i]), len(weights))
        row[f"rows_{rows}"] = {"ms": round(1e3 * seconds, 3), "GB_per_s": round(4 * OUT * IN / seconds / 1e9, 1),
                               "read_GB_per_s": round(read / 1e9, 1),
                               "TFLOP_per_s": round(2 * OUT * IN * rows / seconds / 1e12, 3)}
    return [row]


for line in float32() if sys.argv[1:] == ["float32"] else int8_builds():
    print(json.dumps(line))
