"""Issue 61, seventh stop: the 1.5B target's plain B = 1 step against its floor while the host's read bandwidth
jumps between two levels (~34 and ~56 GB/s here, minute to minute). For `seconds`, pairs of (a 1 GiB float32 sum, one
step over 128 cached columns) alternate; each step's floor is the weights' bytes at the bandwidth read just before
it, and the steps are reported per level (below / above 42 GB/s): their count, the median bandwidth, step and ratio.
One JSON line. Run in the tree to measure:

    BATCHSPEC_CPU_ISA=avx2 PYTHONPATH=src python docs/results/2026-11-28g-cpu/step_bins.py int4 40 after
"""

import json
import statistics
import sys
import time

import torch

from batchspec.bench.costs import weight_bytes
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState
from batchspec.exact.integer import native
from batchspec.models import load_model

torch.set_num_threads(2)
quantize, seconds, code = sys.argv[1], float(sys.argv[2]), sys.argv[3]
model, _ = load_model("qwen2.5-coder:target", progress=False, quantize=quantize)
size_bytes = weight_bytes(model)
runner = ModelRunner(torch.device("cpu"))
block = torch.ones((1 << 30) // 4)


def bandwidth() -> float:
    started = time.perf_counter()
    block.sum()
    return (1 << 30) / (time.perf_counter() - started)


steps = []  # (GB/s, ms, x floor)
with torch.inference_mode():
    cache = BatchKVCache.for_model(model)
    ids = torch.randint(2, 1000, (1, 129), generator=torch.Generator().manual_seed(0))
    batch = BatchState.dense(ids, cache)
    runner.read(model, batch, cache, batch.tokens[:, :128])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        read = bandwidth()
        cache.crop(128)
        started = time.perf_counter()
        runner.logits(model, batch, cache, batch.tokens[:, 128:], keep=1)
        step = time.perf_counter() - started
        steps.append((read / 1e9, 1e3 * step, step / (size_bytes / read)))
result = {"code": code, "build": native.isa(), "quantize": quantize, "weights_gb": round(size_bytes / 1e9, 3)}
for name, low, high in (("low", 0, 42), ("high", 42, 1000)):
    level = [s for s in steps if low <= s[0] < high]
    if level:
        result[name] = {"steps": len(level), "gb_s": round(statistics.median(s[0] for s in level), 1),
                        "ms": round(statistics.median(s[1] for s in level), 2),
                        "x_floor": round(statistics.median(s[2] for s in level), 3)}
print(json.dumps(result), flush=True)
