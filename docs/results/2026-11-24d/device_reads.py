"""Device reads per decode round (calls that wait for the device on CUDA: ``tolist``, ``item``, ``bool(t)``,
``int(t)``, ``nonzero``, ...), counted on the CPU with a ``TorchFunctionMode``, transformers' own calls included.
Tiny random Llama pair, 3 prompts decoded together (batch size 8), 20 new tokens, k = 3. Works on any checkout
since 2026-11-23 (it patches ``Engine.decode``). Prints one JSON line.

    PYTHONPATH=src:tests python docs/results/2026-11-24d/device_reads.py METHOD PROPOSER TEMPERATURE
    e.g. ... eqspec hybrid 0   |   ... autoregressive none 0
"""

import json
import sys
from collections import Counter

import tiny_models
from torch.overrides import TorchFunctionMode

import batchspec
from batchspec.engine.core import Engine

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "equal"}


class Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def main(method: str, proposer: str, temperature: float) -> None:
    target, draft = tiny_models.build_llama(0), tiny_models.build_llama(1)
    count, rounds = Count(), []
    decode = Engine.decode

    def counted(engine, rows):
        rounds.append(len(rows))
        with count:
            decode(engine, rows)

    Engine.decode = counted
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 8, 9, 10] * 2, [11, 12, 13, 14, 15] * 4]
    batchspec.generate(
        target, draft if proposer in ("draft", "hybrid") else None, prompts, method=method,
        proposer=None if method == "autoregressive" else proposer, max_new_tokens=20, temperature=temperature,
        seed=1, eos_token_id=[], num_draft_tokens=3,
    )
    reads = sum(count.calls.values())
    print(json.dumps({"method": method, "proposer": proposer, "temperature": temperature, "rounds": len(rounds),
                      "reads_per_round": round(reads / len(rounds), 2), "by_call": dict(count.calls)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
