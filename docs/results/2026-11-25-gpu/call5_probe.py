"""Eager (no CUDA graphs) bfloat16 autoregressive decoding at B = 8 on the Qwen2.5-7B shape, with fresh prompts each
run: scaled-dot-product attention with every backend allowed (torch's default, which picks cuDNN's on an H100)
against every backend but cuDNN's. Run on the GPU machine as ``PYTHONPATH=src:tests python3 call5_probe.py`` from
the repository root (before the runner excluded cuDNN's attention itself)."""

import json
import sys
import time
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.argv = ["gpu_check", "throughput"]
sys.path[:0] = ["scripts"]
import gpu_check  # noqa: E402

import batchspec  # noqa: E402

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
target = gpu_check.shaped(gpu_check.QWEN_7B, 0, "cuda", torch.bfloat16)
draft = gpu_check.shaped(gpu_check.QWEN_05B, 1, "cuda", torch.bfloat16)
gpu_check.warm_up(target, draft, type("Args", (), {"cuda_graphs": "off"}))
for label, seed, backends in (("default", 8, None), ("no cudnn", 9, NOT_CUDNN), ("default", 10, None),
                              ("no cudnn", 11, NOT_CUDNN)):
    rows = gpu_check.prompts(8, 1000, 100, 200, seed=seed)
    started = time.perf_counter()
    with sdpa_kernel(backends) if backends else nullcontext():
        out = batchspec.generate(target, draft, rows, method="autoregressive", batch_size=8, max_new_tokens=32,
                                 eos_token_id=[])
    seconds = time.perf_counter() - started
    print(json.dumps({"sdpa": label, "seed": seed, "tokens/s": round(8 * 32 / seconds, 1),
                      "verify_s": round(out.stats.verify_s, 3), "prefill_s": round(out.stats.prefill_s, 3)}))
