"""Seconds per greedy step of one prompt: transformers' ``generate`` against batchspec's autoregressive engine.

Loads the ``qwen2.5-coder`` target (float32, packed kernels, ``quantize="none"``) and times N and 1 new tokens for
one chat prompt with each; the difference over N - 1 is the cost of a step, without the prefill. Prints one JSON line.

    python scripts/step_time.py 24
"""

from __future__ import annotations

import json
import sys
import time

import torch

import batchspec
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.models import load_model


def main(steps: int) -> None:
    torch.set_num_threads(2)
    model, tokenizer = load_model("qwen2.5-coder:target", quantize="none", progress=False)
    prompt = format_prompts(load_prompts("humaneval", limit=1), tokenizer)[0]
    ids = torch.tensor([prompt])
    seconds = {}
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # warm-up
        for n in (1, steps):
            started = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False)
            seconds[f"hf_{n}"] = time.perf_counter() - started
            started = time.perf_counter()
            batchspec.generate(model, None, [prompt], method="autoregressive", batch_size=1, max_new_tokens=n,
                               eos_token_id=[])
            seconds[f"batchspec_{n}"] = time.perf_counter() - started
    seconds["hf_step_s"] = (seconds[f"hf_{steps}"] - seconds["hf_1"]) / (steps - 1)
    seconds["batchspec_step_s"] = (seconds[f"batchspec_{steps}"] - seconds["batchspec_1"]) / (steps - 1)
    print(json.dumps(seconds))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 24)
