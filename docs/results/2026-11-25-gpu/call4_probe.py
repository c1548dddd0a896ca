"""Eager (no CUDA graphs) bfloat16 decoding at B = 8 on the Qwen2.5-7B / 0.5B shapes: each run's tokens/s and stage
seconds, then torch's profiler over a short autoregressive run whose shapes had all run before. Run on the GPU
machine as ``PYTHONPATH=src:tests python3 call4_probe.py`` from the repository root."""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.argv = ["gpu_check", "throughput"]
sys.path[:0] = ["scripts"]
import gpu_check  # noqa: E402

import batchspec  # noqa: E402

STAGES = ("prefill_s", "draft_s", "verify_s", "realign_s", "other_s", "gather_s")
target = gpu_check.shaped(gpu_check.QWEN_7B, 0, "cuda", torch.bfloat16)
draft = gpu_check.shaped(gpu_check.QWEN_05B, 1, "cuda", torch.bfloat16)
gpu_check.warm_up(target, draft, type("Args", (), {"cuda_graphs": "off"}))
rows = gpu_check.prompts(8, 1000, 100, 200, seed=8)
cells = (("AR ragged", rows, dict(method="autoregressive"), 32),
         ("AR same length", [r[:100] for r in rows], dict(method="autoregressive"), 32),
         ("eqspec draft k=4 ragged", rows, dict(proposer="draft", num_draft_tokens=4), 16))
for label, prompts, options, new in cells:
    started = time.perf_counter()
    out = batchspec.generate(target, draft, prompts, batch_size=8, max_new_tokens=new, eos_token_id=[], **options)
    seconds = time.perf_counter() - started
    print(json.dumps({"cell": label, "tokens/s": round(8 * new / seconds, 1), "rounds": out.stats.rounds,
                      "wall": round(seconds, 2), **{k: round(getattr(out.stats, k), 3) for k in STAGES}}))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    batchspec.generate(target, draft, rows, method="autoregressive", batch_size=8, max_new_tokens=8, eos_token_id=[])
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
