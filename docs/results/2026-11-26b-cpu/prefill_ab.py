"""Issue 35: a B = 8 prompt read of 150 tokens a row (the int8 1.5B target, KV only, as the bench's prefill reads
HumanEval prompts), the median of 7 after one discarded; one process per code, alternated:

    PYTHONPATH=/tmp/ab_base/src python docs/results/2026-11-26b-cpu/prefill_ab.py before
"""
import statistics
import sys
import time

import torch

from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState
from batchspec.models import load_model

torch.set_num_threads(2)
model, _ = load_model("qwen2.5-coder:target", progress=False)
runner = ModelRunner(torch.device("cpu"))
tokens = torch.randint(2, 1000, (8, 150), generator=torch.Generator().manual_seed(0))
seconds = []
with torch.inference_mode():
    for _ in range(8):
        cache = BatchKVCache.for_model(model)
        batch = BatchState.dense(tokens, cache)
        started = time.perf_counter()
        runner.read(model, batch, cache, tokens)
        seconds.append(time.perf_counter() - started)
print(f"{sys.argv[1]}: B = 8 x 150 tokens read in {statistics.median(seconds[1:]):.3f} s "
      f"({8 * 150 / statistics.median(seconds[1:]):.0f} tokens/s)")
