"""A pair's fingerprint: the sha256 of its models' logits on fixed prompts and of its greedy tokens, per quantize mode.

The exact integer models claim the same bits on every CPU, build, thread count and torch dispatch. The fingerprints of
the presets' pairs are committed (``fingerprints.json`` beside this file, made on the host its ``made_on`` names);
``tests/test_fingerprints.py`` recomputes them on whatever host runs the suite, under every native build it runs and
under ``ATEN_CPU_CAPABILITY=default``, so every machine that runs the tests checks the claim against every machine
before it. A fingerprint changes only in a commit that says which arithmetic changed and why.

    python -m batchspec.bench.fingerprint smollm2 int8 int4     # prints {"int8": {...}, "int4": {...}}
    python -m batchspec.bench.fingerprint smollm2 int8 --check  # exits 1 unless the committed ones are met

What is hashed: each model's float32 logits of every position of each prompt, run alone through the model's own
forward (the exact modules swapped into transformers' layers), and the token ids of a batched EqSpec run (the fused
forward, :mod:`batchspec.exact.integer.forward`) of the prompts together, and of a seeded sampled run (temperature
0.9, top-p 0.95) with each token's logprob and its 3 most probable alternatives': the sampler's and the logprobs' bits
(:mod:`batchspec.engine.exactmath`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

FINGERPRINTS = Path(__file__).with_name("fingerprints.json")
PROMPTS = (
    "def fibonacci(n):",
    "# quicksort in Python\n",
    "The capital of France is",
    "SELECT name FROM users WHERE",
)
NEW_TOKENS = 16  # greedy tokens per prompt
DRAFT_TOKENS = 4
SEED = 7  # the seeded run's (temperature 0.9, top-p 0.95), which reports LOGPROBS alternatives of every token
LOGPROBS = 3


@torch.inference_mode()
def fingerprint(pair: Any) -> dict[str, str]:
    """``{"target logits", "draft logits", "greedy tokens", "sampled tokens and logprobs"}``: sha256 hex digests of
    ``pair``'s (a :class:`~batchspec.models.pair.ModelPair`) logits, greedy tokens and seeded sampled tokens with
    their logprobs (the floats' exact bits, as hex) on :data:`PROMPTS`."""
    from batchspec.api import generate

    rows = [pair.tokenizer.encode(text) for text in PROMPTS]
    digest = {}
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        logits = [model(torch.tensor([row])).logits[0].float() for row in rows]  # [L, V] each
        digest[f"{role} logits"] = _sha(b"".join(t.contiguous().numpy().tobytes() for t in logits))
    run = dict(method="eqspec", proposer="draft", batch_size=len(rows), max_new_tokens=NEW_TOKENS,
               num_draft_tokens=DRAFT_TOKENS, draft_vocabulary=0, eos_token_id=[])  # the draft's whole vocabulary:
    result = generate(pair.target, pair.draft, rows, **run)  # a seeded run's samples follow its drafts' q
    digest["greedy tokens"] = _sha(json.dumps(result.sequences).encode())
    sampled = generate(pair.target, pair.draft, rows, **run, seed=SEED, temperature=0.9, top_p=0.95,
                       logprobs=LOGPROBS)
    logprobs = [[(t.token, t.logprob.hex(), [(i, v.hex()) for i, v in t.top]) for t in row] for row in sampled.logprobs]
    digest["sampled tokens and logprobs"] = _sha(json.dumps([sampled.sequences, logprobs]).encode())
    return digest


def committed(preset: str) -> dict[str, dict[str, str]]:
    """The committed fingerprints of ``preset``'s pair, by quantize mode."""
    return json.loads(FINGERPRINTS.read_text(encoding="utf-8"))["presets"][preset]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str]) -> int:
    """``PRESET MODE [MODE ...] [--check]``: print each mode's fingerprint as JSON; with ``--check``, exit 1 unless
    each equals the committed one."""
    from batchspec.models import load_pair

    check = "--check" in argv
    preset, *modes = [a for a in argv if a != "--check"]
    out = {mode: fingerprint(load_pair(preset, quantize=mode, progress=False)) for mode in modes}
    print(json.dumps(out, indent=1, sort_keys=True))
    if check:
        want = committed(preset)
        return 0 if all(out[mode] == want.get(mode) for mode in modes) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
