"""int8 x int8 -> int32 (``torch._int_mm``) against float32 ``F.linear`` for one 1536 -> 8960 projection
(qwen2.5-coder-1.5B's MLP), 2 threads, median of 20 after warm-up; and whether row 0's int32 result is the same
alone and inside a batch of 256. Prints one JSON line.

    python docs/results/2026-11-24d/int8_gemm.py
"""

import json
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
weight = torch.randn(8960, 1536, generator=generator)
weight_t8 = torch.randint(-127, 128, (1536, 8960), dtype=torch.int8, generator=generator)


def median_ms(call, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(sorted(times)[repeats // 2] * 1000, 3)


results = {}
for rows in (1, 8, 17, 48, 256):
    x = torch.randn(rows, 1536, generator=generator)
    x8 = torch.randint(-127, 128, (rows, 1536), dtype=torch.int8, generator=generator)
    results[f"M={rows}"] = {
        "float32_linear_ms": median_ms(lambda x=x: F.linear(x, weight)),
        "int8_int_mm_ms": median_ms(lambda x8=x8: torch._int_mm(x8, weight_t8)),
    }
alone = torch._int_mm(x8[:1], weight_t8)[0]  # row 0 of the last (256-row) batch, alone
inside = torch._int_mm(x8, weight_t8)[0]
print(json.dumps({"torch": torch.__version__, "row0_same_alone_and_in_batch": bool(torch.equal(alone, inside)),
                  **results}))
