"""How far float32 forwards on the CPU are from batch-invariant (what issue 26 must close): smollm2's target as
batchspec loads it (float32, packed kernels), through the model runner. A row's logits at its last position:
alone vs left-padded in a batch of two; and a 1-token step vs the same position inside a 5-token verification.
Prints one JSON line.

    python docs/results/2026-11-24d/float_invariance.py
"""

import json

import torch

from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState, HostColumns
from batchspec.models import load_model

torch.set_num_threads(2)
model, _ = load_model("smollm2:target", progress=False)
runner = ModelRunner(torch.device("cpu"))
generator = torch.Generator().manual_seed(0)
short = torch.randint(100, 40000, (40,), generator=generator).tolist()
long = torch.randint(100, 40000, (60,), generator=generator).tolist()


def batch_of(rows: list[list[int]]) -> tuple[BatchState, BatchKVCache]:
    width = max(map(len, rows))
    pad = [width - len(r) for r in rows]
    tokens = torch.tensor([[0] * p + r for p, r in zip(pad, rows, strict=True)])
    cache = BatchKVCache.for_model(model)
    host = HostColumns(pad=pad, content=[len(r) for r in rows], draft_cached=[0] * len(rows))
    state = BatchState([], torch.tensor(pad), torch.tensor(host.content), Slab(tokens, cache, None),
                       torch.zeros(len(rows), dtype=torch.long), host)
    return state, cache


def last_logits(rows: list[list[int]], steps: int) -> torch.Tensor:
    """Row 0's logits at each of its last ``steps`` positions, read with one forward of ``steps`` columns."""
    batch, cache = batch_of(rows)
    with torch.inference_mode():
        runner.read(model, batch, cache, batch.tokens[:, : batch.width - steps])
        return runner.logits(model, batch, cache, batch.tokens[:, batch.width - steps :], keep=steps)[0]


alone = last_logits([short], 1)[-1]
batch, cache = batch_of([long, short])  # the short row padded by 20
with torch.inference_mode():
    runner.read(model, batch, cache, batch.tokens[:, : batch.width - 1])
    in_batch = runner.logits(model, batch, cache, batch.tokens[:, batch.width - 1 :], keep=1)[1, -1]
verify = last_logits([short], 5)  # the last 5 positions in one forward
steps = [last_logits([short[: len(short) - 4 + i]], 1)[-1] for i in range(5)]  # each alone, one token at a time
print(json.dumps({
    "padded_in_batch_of_2_equal": bool(torch.equal(alone, in_batch)),
    "padded_in_batch_of_2_max_abs_diff": float((alone - in_batch).abs().max()),
    "verify_5_vs_steps_equal": [bool(torch.equal(verify[i], steps[i])) for i in range(5)],
    "verify_5_vs_steps_max_abs_diff": max(float((verify[i] - steps[i]).abs().max()) for i in range(5)),
    "argmax_same": bool(alone.argmax() == in_batch.argmax()),
}))
