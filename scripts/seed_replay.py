"""The load test without a server: its catalogue through the server's scheduler, each answer against its lone run.

Loads the ``smollm2`` preset (float32, ``quantize="none"``), builds the load test's requests
(``scripts/locustfile.py``: its first four prompts as completions and as chat, greedy or seeded with seed
1000 + index, temperature 0.8, top-p 0.95, 32 tokens), and drives ROUNDS rounds of ROWS random requests through the
engine with the server's scheduler (``Batches`` refilled online, batch size 8, chunked prefill ``auto``), admitting
each waiting request with probability 0.3 before a round, as requests arrive at a server. Every answer is compared
with the same request run alone (batch size 1). Prints one JSON line per difference and a summary line.

    python scripts/seed_replay.py 7 4 32        # random seed, rounds of requests, requests per round
"""

from __future__ import annotations

import json
import random
import sys

import torch

import batchspec
from batchspec.config import SamplingParams, SpecConfig
from batchspec.engine.core import build_engine
from batchspec.engine.sampling import derive_row_seeds
from batchspec.engine.schedulers import make_scheduler
from batchspec.engine.schedulers.drive import Offline, drive
from batchspec.engine.state import Sequence
from batchspec.models import load_pair

PROMPTS = (  # the first four prompts of scripts/locustfile.py
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "def quicksort(items):",
)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95)
TOKENS = 32


class Arrivals(Offline):
    """Driver hooks: before each round every waiting request arrives with probability 0.3 (up to 8 at once)."""

    def __init__(self, rows: list[Sequence], rng: random.Random) -> None:
        super().__init__(lambda finished: None)
        self.pending, self.rng = list(rows), rng

    def admit(self, scheduler) -> bool:
        while self.pending and scheduler.running + scheduler.waiting < 8 and self.rng.random() < 0.3:
            scheduler.add(self.pending.pop(0))
        return bool(self.pending) or super().admit(scheduler)


def catalogue(tokenizer) -> list[tuple[str, list[int], int]]:
    """(name, prompt ids, seed) of every prompt as a completion and as a chat message."""
    requests = []
    for index, text in enumerate(PROMPTS):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
        requests.append((f"completions {index}", tokenizer(text, add_special_tokens=True)["input_ids"], 1000 + index))
        requests.append((f"chat {index}", list(chat), 1000 + index))
    return requests


def main(seed: int, rounds: int, rows_per_round: int) -> None:
    torch.set_num_threads(2)
    pair = load_pair("smollm2", quantize="none", progress=False)
    requests = catalogue(pair.tokenizer)
    alone = {}
    for name, ids, row_seed in requests:
        for sampling in (SamplingParams(), SEEDED):
            result = batchspec.generate(pair.target, pair.draft, [ids], batch_size=1, max_new_tokens=TOKENS,
                                        temperature=sampling.temperature, top_p=sampling.top_p, seed=row_seed)
            alone[name, sampling.greedy] = result.sequences[0]
    rng = random.Random(seed)
    differ = total = 0
    for round_ in range(rounds):
        engine = build_engine(pair.target, pair.draft, SpecConfig(batch_size=8, prefill_chunk="auto"))
        chosen = [(rng.choice(requests), rng.random() < 0.5) for _ in range(rows_per_round)]
        rows = [Sequence(i, list(ids), TOKENS, sampling=SEEDED if seeded else SamplingParams(),
                         seed=derive_row_seeds(row_seed, 1)[0])
                for i, ((_, ids, row_seed), seeded) in enumerate(chosen)]
        with torch.inference_mode():
            drive(engine, make_scheduler(engine.config, online=True), Arrivals(rows, rng))
        for row, ((name, _, _), seeded) in zip(rows, chosen, strict=True):
            want = alone[name, not seeded]
            total += 1
            if row.output != want:
                differ += 1
                at = next((j for j, (a, b) in enumerate(zip(row.output, want, strict=False)) if a != b), None)
                print(json.dumps({"round": round_, "request": name, "seeded": seeded, "differs_at": at}), flush=True)
    print(json.dumps({"answers": total, "differ": differ}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
