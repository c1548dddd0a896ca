"""Time spent in each part of one int8 forward of the qwen2.5-coder target (docs/int8.md, *What each part costs*):

    PYTHONPATH=src python docs/results/2026-11-24e/parts.py

Each part is wrapped in a timer (the wrappers add a little); ms per forward.
"""

import collections
import functools
import time

import torch
from transformers import AttentionInterface, DynamicCache

from batchspec.int8 import attention, linear, quantize_model
from batchspec.int8 import model as int8_model
from batchspec.memory import keep_freed_memory
from batchspec.models import load_model

spent: collections.Counter = collections.Counter()


def timed(name, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        spent[name] += time.perf_counter() - started
        return result

    return wrapper


target, _ = load_model("qwen2.5-coder:target", quantize="none", kernels="default", progress=False)
quantize_model(target)
keep_freed_memory()
AttentionInterface.register(attention.NAME, timed("attention", attention.exact_attention))
linear.Int8Linear.forward = timed("linear layers outside the MLP", linear.Int8Linear.forward)
linear.Int8MLP.forward = timed("MLP", linear.Int8MLP.forward)
int8_model.ExactRMSNorm.forward = timed("RMSNorm", int8_model.ExactRMSNorm.forward)
linear.int_matmul = timed("int8 products", linear.int_matmul)
linear.quantize_activations = timed("activation quantization", linear.quantize_activations)
torch.manual_seed(0)
for batch, cached, new in ((8, 150, 1), (8, 250, 6), (1, 250, 8), (8, 150, 0)):
    with torch.no_grad():
        cache = DynamicCache()
        spent.clear()
        started = time.perf_counter()
        target(torch.randint(100, 20000, (batch, cached)), past_key_values=cache, logits_to_keep=1)
        prefill = time.perf_counter() - started
        if new == 0:
            parts = {k: round(v * 1e3) for k, v in spent.items()}
            print(f"prefill B={batch} S={cached}: {prefill * 1e3:.0f} ms", parts)
            continue
        step = torch.randint(100, 20000, (batch, new))
        target(step, past_key_values=cache)
        cache.crop(-new)
        spent.clear()
        started = time.perf_counter()
        for _ in range(3):
            target(step, past_key_values=cache)
            cache.crop(-new)
        seconds = (time.perf_counter() - started) / 3
    parts = {k: round(v * 1e3 / 3, 1) for k, v in spent.items()}
    print(f"B={batch}, {cached} cached, {new} new: {seconds * 1e3:.1f} ms", parts)
