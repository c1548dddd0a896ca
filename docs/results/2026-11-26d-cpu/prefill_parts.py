"""Issue 35: where a prompt reading goes (the int8 1.5B target, KV only): seconds in each native C call (timed
around the ctypes call) and the rest, for ``rows`` prompts of ``length`` random tokens, the last of 3 readings. One
process per code, alternated (``run_all.sh``):

    PYTHONPATH=/tmp/ab_final/src python docs/results/2026-11-26d-cpu/prefill_parts.py after 8 150
"""
import collections
import sys
import time

import torch

from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState
from batchspec.int8 import native
from batchspec.memory import keep_freed_memory
from batchspec.models import load_model

keep_freed_memory()
torch.set_num_threads(2)
model, _ = load_model("qwen2.5-coder:target", progress=False)
runner = ModelRunner(torch.device("cpu"))
rows, length = int(sys.argv[2]), int(sys.argv[3])
tokens = torch.randint(2, 1000, (rows, length), generator=torch.Generator().manual_seed(0))
functions, spent = native.library(), collections.Counter()


def timed(name, function):
    def call(*args):
        started = time.perf_counter()
        out = function(*args)
        spent[name] += time.perf_counter() - started
        return out
    return call


for name, function in list(vars(functions).items()):
    setattr(functions, name, timed(name, function))
with torch.inference_mode():
    for _ in range(3):
        spent.clear()
        cache = BatchKVCache.for_model(model)
        batch = BatchState.dense(tokens, cache)
        started = time.perf_counter()
        runner.read(model, batch, cache, tokens)
        total = time.perf_counter() - started
parts = ", ".join(f"{name} {seconds:.3f}" for name, seconds in spent.most_common(3))
print(f"{sys.argv[1]}: {rows} x {length} tokens read in {total:.3f} s: {parts}, rest "
      f"{total - sum(spent.values()):.3f}")
