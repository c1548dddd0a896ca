"""How close seeded sampling's decisions come to flipping in float32: the rounding side of the seed guarantee.

A seeded row's tokens do not depend on its batch in exact arithmetic (``tests/test_sampling_e2e.py`` checks that on
float64 models under any schedule). In float32 a batched forward rounds differently from a single-row one, and a
decision flips when its random number lies closer to its threshold than that rounding moves it. This script
measures both sides on the ``smollm2`` preset (float32, the default kernels):

* drift: the largest change of the last position's logits, and of the cumulative sampling probabilities
  (temperature 0.8), between 8 left-padded prompts read in one batch and each read alone;
* margins: every accept test (``u * q(d)`` against ``p(d)``, relative distance) and every inverse-CDF draw (distance
  of ``u`` to the nearest boundary of the cumulative distribution) of a seeded run of N prompts (SpecBench, 32 new
  tokens, temperature 0.8, top-p 0.95, batch size 8), counted below a few thresholds;
* the smallest margin behind the first two tokens of each seeded completions request of the load test, run alone.

Draws are counted whether or not the round ends up using them (the verifier draws a recovered and a plain token for
every row). Prints one JSON line.

    python scripts/sampling_margins.py 64
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import torch

import batchspec
import batchspec.engine.proposers.draft as draft_proposer
import batchspec.engine.verifier as verifier
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.engine.sampling import inverse_cdf
from batchspec.models import load_pair

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"
TEMPERATURE = 0.8
LOAD_TEST_PROMPTS = (  # the first four prompts of scripts/locustfile.py (its default --prompts 4)
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "def quicksort(items):",
)


def drift(pair, prompts: list[list[int]]) -> dict:
    """Largest logit and cumulative-probability change between a batched and a single-row forward."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L], left-padded
    mask = torch.zeros_like(ids)  # [B, L]
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.inference_mode():
        batched = pair.target(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        logits, cdf = 0.0, 0.0
        for i, prompt in enumerate(prompts):
            alone = pair.target(input_ids=torch.tensor([prompt])).logits[0, -1].double()  # [V]
            together = batched.logits[i, -1].double()  # [V]
            logits = max(logits, (alone - together).abs().max().item())
            cdfs = [torch.softmax(x / TEMPERATURE, -1).cumsum(-1) for x in (alone, together)]
            cdf = max(cdf, (cdfs[0] - cdfs[1]).abs().max().item())
    return {"max_logit_drift": logits, "max_cdf_drift": cdf}


@contextmanager
def recorded_margins():
    """While inside, every accept test's relative margin goes to ``accepts`` and every draw's to ``draws``."""
    accepts: list[torch.Tensor] = []
    draws: list[torch.Tensor] = []
    accept, sample_draft = verifier._accept, draft_proposer.sample_draft

    def recording_accept(u, p_draft, q_draft):
        accepts.append(((u * q_draft - p_draft).abs() / p_draft.clamp(min=1e-300)).flatten())
        return accept(u, p_draft, q_draft)

    def recording_draw(probs, u):
        cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
        total = cdf[..., -1:]  # [..., 1]
        point = u.to(torch.float64)[..., None] * total  # [..., 1]
        draws.append(((cdf - point).abs().min(-1).values / total.squeeze(-1)).flatten())
        return inverse_cdf(probs, u)

    verifier._accept, verifier.inverse_cdf = recording_accept, recording_draw
    draft_proposer.sample_draft = lambda q, u: (recording_draw(q, u), sample_draft(q, u))[1]
    try:
        yield accepts, draws
    finally:
        verifier._accept, verifier.inverse_cdf, draft_proposer.sample_draft = accept, inverse_cdf, sample_draft


def margins(pair, prompts: list[list[int]]) -> dict:
    """Counts of decisions of a seeded batched run whose margin is below each threshold."""
    with recorded_margins() as (accepts, draws):
        result = batchspec.generate(pair.target, pair.draft, prompts, batch_size=8, max_new_tokens=32,
                                    temperature=TEMPERATURE, top_p=0.95, seed=99)
    a, d = torch.cat(accepts), torch.cat(draws)
    counts = {"tokens": result.stats.generated_tokens, "accept_tests": a.numel(), "draws": d.numel()}
    counts.update({f"accept_relative_margin_below_{e:g}": int((a < e).sum()) for e in (1e-5, 1e-4, 1e-3)})
    counts.update({f"draw_margin_below_{e:g}": int((d < e).sum()) for e in (1e-6, 2.2e-6, 1e-5, 1e-4)})
    return counts


def load_test_requests(pair) -> dict:
    """The smallest margin of any decision behind the first two tokens of the load test's seeded completions
    requests (``scripts/locustfile.py``: its first four prompts, seed 1000 + index), each run alone."""
    smallest = {}
    for index, text in enumerate(LOAD_TEST_PROMPTS):
        ids = pair.tokenizer(text, add_special_tokens=True)["input_ids"]
        with recorded_margins() as (accepts, draws):
            batchspec.generate(pair.target, pair.draft, [ids], batch_size=1, max_new_tokens=2,
                               temperature=TEMPERATURE, top_p=0.95, seed=1000 + index)
        smallest[text] = min(float(torch.cat(found).min()) for found in (accepts, draws) if found)
    return {"load_test_smallest_margin_first_two_tokens": smallest}


def main(n: int) -> None:
    torch.set_num_threads(2)
    pair = load_pair("smollm2", dtype="float32", quantize="none", progress=False)
    records = [r for i, r in enumerate(load_prompts(SPEC_BENCH)) if i % 5 == 1][:n]
    prompts = [p[-200:] for p in format_prompts(records, pair.tokenizer)]
    print(json.dumps({"prompts": n, **drift(pair, prompts[:8]), **margins(pair, prompts), **load_test_requests(pair)}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
