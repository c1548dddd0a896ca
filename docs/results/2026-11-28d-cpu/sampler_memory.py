"""The sampler's transient memory and time on [8, 5, 151936] logits, seeded rows with top-p 0.95 (the load test's).

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536 OMP_NUM_THREADS=1 python sampler_memory.py

With those settings every large block is mapped on its own and returned when freed, so the peak resident set's rise
is the largest working set of the call.
"""

import resource
import time

import torch

from batchspec.config import SamplingParams
from batchspec.engine.logprobs import scored
from batchspec.engine.sampling import RowParams, warp_rows


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 5, 151936) * 4  # [B, k+1, V]
    params = RowParams.of([SamplingParams(temperature=0.8, top_p=0.95)] * 8)
    tokens = torch.randint(0, 151936, (8, 5))  # [B, k+1]
    before = peak()
    best = []
    for _ in range(3):
        started = time.perf_counter()
        warp_rows(logits, params)
        best.append(time.perf_counter() - started)
    warped = peak()
    started = time.perf_counter()
    scored(logits, tokens, 5)
    scoring = time.perf_counter() - started
    print(f"warp_rows: +{(warped - before) / 1e6:.0f} MB, best of 3 {min(best) * 1e3:.0f} ms; "
          f"scored: +{(peak() - before) / 1e6:.0f} MB (peak so far), {scoring * 1e3:.0f} ms; "
          f"one [8, 5, V] float64 tensor: {8 * 5 * 151936 * 8 / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
