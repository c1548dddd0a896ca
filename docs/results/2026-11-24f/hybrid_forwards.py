"""Hybrid proposer on smollm2 (float32, quantize none): acceptance, draft forwards, a hash of the tokens and the
time, for the hybrid lookup change (device lookups after a model-drafted token). Prints one JSON line per case.

    PYTHONPATH=src python docs/results/2026-11-24f/hybrid_forwards.py            # the CPU's policy (free reads)
    PYTHONPATH=src python docs/results/2026-11-24f/hybrid_forwards.py gpu-policy # no reads in the draft loop
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import batchspec as bs
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.engine.core import Engine
from batchspec.engine.proposers.draft import DraftModelProposer
from batchspec.models import load_pair

forwards = 0
step = DraftModelProposer._model_step


def counted(self, *args, **kwargs):
    global forwards
    forwards += 1
    return step(self, *args, **kwargs)


DraftModelProposer._model_step = counted
decode = Engine.decode
if sys.argv[1:] == ["gpu-policy"]:

    def gpu_policy(engine, rows):
        engine.runner.free_reads = False
        decode(engine, rows)

    Engine.decode = gpu_policy
pair = load_pair("smollm2", quantize="none", progress=False)
prompts = format_prompts(load_prompts("humaneval", limit=8), pair.tokenizer)
for batch_size, k in ((8, 4), (1, 3)):
    forwards = 0
    started = time.perf_counter()
    result = bs.generate(
        pair.target,
        pair.draft,
        prompts,
        method="eqspec",
        proposer="hybrid",
        num_draft_tokens=k,
        batch_size=batch_size,
        max_new_tokens=128,
        progress=False,
    )
    seconds = time.perf_counter() - started
    stats = result.stats
    print(
        json.dumps(
            dict(
                batch_size=batch_size,
                k=k,
                accepted=stats.draft_tokens_accepted,
                proposed=stats.draft_tokens_proposed,
                draft_forwards=forwards,
                tokens_sha256=hashlib.sha256(json.dumps(result.sequences).encode()).hexdigest()[:16],
                generated=stats.generated_tokens,
                seconds=round(seconds, 2),
            )
        )
    )
