"""The exact int8 product kernels against each other and the machine's read bandwidth (issue 35); ``kernels.txt``.

    PYTHONPATH=src python docs/results/2026-11-25c-cpu/kernels.py

Each product streams ``count`` distinct int8 weights from memory, as a forward does (best of 3 passes): oneDNN's
prepacked quantized linear (the ``onednn`` kernel) and batchspec's AVX-512 VNNI kernel (``vnni``,
:func:`batchspec.int8.native.linear` with unit scales), at 1, 8, 48 and 256 rows. GB/s is the weight's bytes over
the time; GOP/s counts a multiply and an add per weight and row. The read bandwidth is ``batchspec costs``' own
measure (a sum over 1 GiB of float32).
"""

from __future__ import annotations

import json
import time

import torch

from batchspec.bench.costs import read_bandwidth
from batchspec.int8 import native
from batchspec.int8.product import activation_codes, int_product, pack_weight

SHAPES = ((1536, 8960, 12), (8960, 1536, 12), (1536, 1536, 60), (1536, 256, 200), (1536, 151936, 2))
ROWS = (1, 8, 48, 256)


def _best(product, weights, passes: int = 3) -> float:
    for weight in weights:
        product(weight)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for weight in weights:
            product(weight)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best


def main() -> None:
    torch.manual_seed(0)
    print(json.dumps({"read_bandwidth_GBps": round(read_bandwidth() / 1e9, 1), "threads": torch.get_num_threads()}))
    for inner, outer, count in SHAPES:
        weights = [torch.randint(-127, 128, (outer, inner), dtype=torch.int8) for _ in range(count)]
        onednn = [pack_weight(w, "onednn") for w in weights]
        vnni = [pack_weight(w, "vnni") for w in weights]
        for rows in ROWS:
            q = torch.randint(-127, 128, (rows, inner)).float()  # [N, K]
            by_onednn, by_vnni = activation_codes(q, "onednn"), activation_codes(q, "vnni")
            unit = torch.ones(rows, 1), torch.ones(outer)
            seconds = {
                "onednn": _best(lambda w, c=by_onednn: int_product(c, w, torch.float32), onednn),
                "vnni": _best(lambda w, c=by_vnni, u=unit: native.linear(c, *w.tensors, *u), vnni),
            }
            cell = {"K": inner, "O": outer, "rows": rows}
            for kernel, s in seconds.items():
                cell[kernel] = {"ms": round(s * 1e3, 3), "GBps": round(inner * outer / s / 1e9, 1),
                                "GOPps": round(2 * inner * outer * rows / s / 1e9)}
            print(json.dumps(cell), flush=True)


if __name__ == "__main__":
    main()
