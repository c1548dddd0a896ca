"""Issue 35: one forward of the int8 1.5B target (128 cached columns) at (B, new tokens) = (1, 1), (8, 5), (1, 5),
split into batchspec's native calls and the rest (torch and Python), the median of 11; run once per code, alternated:

    PYTHONPATH=/tmp/ab_base/src python docs/results/2026-11-26-cpu/stacked_forward_split.py ab_base
"""

import collections
import statistics
import sys
import time

import torch

from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState
from batchspec.int8 import native
from batchspec.models import load_model

spent: collections.Counter = collections.Counter()


def timed(name: str):
    function = getattr(native, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = function(*args, **kwargs)
        spent[name] += time.perf_counter() - started
        return out

    return wrapper


def main(label: str) -> None:
    torch.set_num_threads(2)
    model, _ = load_model("qwen2.5-coder:target", progress=False)
    for name in ("linear", "quantize", "rms_norm", "pack_kv", "attention"):
        setattr(native, name, timed(name))
    runner = ModelRunner(torch.device("cpu"))
    with torch.inference_mode():
        for size, tokens in ((1, 1), (8, 5), (1, 5)):
            cache = BatchKVCache.for_model(model)
            batch = BatchState.dense(torch.randint(2, 1000, (size, 128 + tokens)), cache)
            runner.read(model, batch, cache, batch.tokens[:, :128])
            totals, natives = [], []
            for _ in range(12):
                cache.crop(128)
                spent.clear()
                started = time.perf_counter()
                runner.logits(model, batch, cache, batch.tokens[:, 128:], keep=tokens)
                totals.append(time.perf_counter() - started)
                natives.append(sum(spent.values()))
            total, inside = statistics.median(totals[1:]), statistics.median(natives[1:])
            print(f"{label} ({size}, {tokens}) total {1e3 * total:.1f} rest {1e3 * (total - inside):.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
