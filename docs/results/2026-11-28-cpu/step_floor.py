"""Issue 61: the 1.5B target's forward (128 cached columns) against its floor, int4 beside int8, on a host whose read
bandwidth moves by 2x within minutes: 20 pairs of (a 1 GiB float32 sum, a forward) alternated, each forward divided by
the weights' bytes at the bandwidth read just before it; the median of those ratios. (B, new tokens) = (1, 1), a
plain step; (1, 5), a verification of 4 drafts; (8, 5), a B = 8 one. One process per quantize mode and build:

    BATCHSPEC_CPU_ISA=avx2 PYTHONPATH=src python docs/results/2026-11-28-cpu/step_floor.py int4
"""

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
quantize = sys.argv[1]
model, _ = load_model("qwen2.5-coder:target", progress=False, quantize=quantize)
size_bytes = weight_bytes(model)
runner = ModelRunner(torch.device("cpu"))
block = torch.ones((1 << 30) // 4)


def bandwidth() -> float:
    started = time.perf_counter()
    block.sum()
    return (1 << 30) / (time.perf_counter() - started)


out = [f"{quantize} {native.isa()}", f"weights {size_bytes / 1e9:.3f} GB"]
with torch.inference_mode():
    for size, tokens in ((1, 1), (1, 5), (8, 5)):
        cache = BatchKVCache.for_model(model)
        ids = torch.randint(2, 1000, (size, 128 + tokens), generator=torch.Generator().manual_seed(0))
        batch = BatchState.dense(ids, cache)
        runner.read(model, batch, cache, batch.tokens[:, :128])
        ratios, steps, reads = [], [], []
        for i in range(21):
            read = bandwidth()
            cache.crop(128)
            started = time.perf_counter()
            runner.logits(model, batch, cache, batch.tokens[:, 128:], keep=tokens)
            step = time.perf_counter() - started
            if i:
                ratios.append(step / (size_bytes / read))
                steps.append(step)
                reads.append(read)
        median_step, median_read = statistics.median(steps), statistics.median(reads)
        out.append(f"({size},{tokens}) {1e3 * median_step:.1f} ms, bw {median_read / 1e9:.1f}, "
                   f"x floor {statistics.median(ratios):.2f}")
print(" | ".join(out))
