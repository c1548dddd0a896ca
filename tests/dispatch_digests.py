"""sha256 digests of the sampler's probabilities, the logprobs and the exp and log under them, on fixed seeded
inputs: what ``tests/test_sampling.py`` compares between processes that torch dispatches to different instruction
sets (``ATEN_CPU_CAPABILITY`` is read once, when torch starts) and between thread counts.

Run as a script (``python tests/dispatch_digests.py``) it prints the JSON of :func:`digests` for 1, 2 and 16 threads.
It then loads torch and four of batchspec's modules alone: the packages' ``__init__`` would import transformers,
0.6 s of the 2 s a process takes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import types

THREADS = (1, 2, 16)
VOCAB = 50_000


def digests(threads: int) -> dict[str, str]:
    """``{output: sha256 of its bytes}`` computed with ``threads`` torch threads (restored after): ``warp_rows`` of
    logits ``[4, 3, V]`` with a temperature row, a top-k row, a top-p row and a top-k-then-top-p row; ``scored`` of
    the same logits (top 20); ``exp_nonpositive`` down to its underflow; ``log`` of float64 bit patterns drawn
    uniformly (every binade, subnormals included)."""
    import torch

    from batchspec.config import SamplingParams
    from batchspec.engine.exactmath import exp_nonpositive, log
    from batchspec.engine.logprobs import scored
    from batchspec.engine.sampling import RowParams, warp_rows

    generator = torch.Generator().manual_seed(63)
    # torch.rand is the same bits under every dispatch (random integers scaled by a power of two); float32 randn is
    # not (its scalar and AVX2 paths differ); float32, as a model's logits are, with some ties among 50,000 draws
    logits = torch.rand(4, 3, VOCAB, generator=generator) * 24 - 12  # [4, 3, V]
    tokens = torch.randint(0, VOCAB, (4, 3), generator=generator)  # [4, 3]
    arguments = torch.rand(VOCAB, generator=generator, dtype=torch.float64) * -750  # [V]
    positives = torch.randint(1, 0x7FF0000000000000, (VOCAB,), generator=generator).view(torch.float64)  # [V]
    params = RowParams.of(
        [
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=1.3, top_k=40),
            SamplingParams(temperature=0.9, top_p=0.9),
            SamplingParams(temperature=1.1, top_k=1000, top_p=0.8),
        ]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outputs = {
            "warp_rows": warp_rows(logits, params),
            "scored": scored(logits, tokens, 20),
            "exp_nonpositive": exp_nonpositive(arguments),
            "log": log(positives),
        }
    finally:
        torch.set_num_threads(before)
    return {name: hashlib.sha256(value.contiguous().numpy().tobytes()).hexdigest() for name, value in outputs.items()}


def _packages_without_their_init() -> None:
    """``batchspec`` and ``batchspec.engine`` as empty packages over their directories, so that importing a module
    of theirs runs that module alone."""
    spec = importlib.util.find_spec("batchspec")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("batchspec is not importable from this process's path")
    roots = list(spec.submodule_search_locations)
    for name, path in (("batchspec", roots), ("batchspec.engine", [os.path.join(root, "engine") for root in roots])):
        package = types.ModuleType(name)
        package.__path__ = path
        sys.modules[name] = package


if __name__ == "__main__":
    _packages_without_their_init()
    print(json.dumps({str(threads): digests(threads) for threads in THREADS}))
