"""Issue 35: one layer's exact attention (the 1.5B target's 12 heads over 2 KV heads of 128) as a prompt reading
calls it, for 150 and 1,153 causal tokens, and as a decode step calls it (6 queries of B = 8 rows over 1,024 cached
tokens): the median of 9 runs after one discarded, and a checksum of the output (the two codes' KV caches round 32
of a head's values apart, so their sums differ slightly). One process per code, alternated (``run_all.sh``):

    PYTHONPATH=/tmp/ab_final/src python docs/results/2026-11-26e-cpu/attention_speed.py final
"""
import statistics
import sys
import time

import torch

from batchspec.int8.attention import exact_attention, pack

torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
for batch, queries, length in ((8, 150, 150), (1, 1153, 1153), (8, 6, 1024)):
    query = torch.randn(batch, 12, queries, 128, generator=generator)
    key, value = (pack(torch.randn(batch, 2, length, 128, generator=generator)) for _ in "kv")
    visible = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)[None, None].expand(batch, 1, -1, -1)
    seconds = []
    for _ in range(10):
        started = time.perf_counter()
        out = exact_attention(query, key, value, visible, 128**-0.5)
        seconds.append(time.perf_counter() - started)
    print(f"{sys.argv[1]}: B = {batch}, {queries} queries over {length} keys: "
          f"{statistics.median(seconds[1:]) * 1e3:7.2f} ms, checksum {out.double().sum().item():.9f}")
