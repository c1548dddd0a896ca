"""The adaptive draft-length planner and the chunked-prefill budget, in simulated worlds with known costs.

The planner is driven round after round by a simulator whose forward costs follow the shape measured on 2 CPU
cores (a round costs ``c_0 (1 + slope K)``: slope ~0.5 at B = 8, ~0.02 at B = 1) and whose drafts are accepted
with a known chance. Its realised tokens per second are compared with plain steps (``B / c_0``): where
speculation cannot pay it must stay within 3% of them, and where it pays it must find most of the gain.
"""

from __future__ import annotations

import random

import pytest

from batchspec.controller import AdaptiveLength, Reach, RoundRecord
from batchspec.prefill import FIRST_AUTO_CHUNK, MIN_AUTO_CHUNK, ChunkBudget
from batchspec.state import Sequence


def accepted_chain(rng: random.Random, proposed: int, chance: float) -> int:
    """Drafts accepted of ``proposed``, each accepted with ``chance`` once the ones before it were."""
    accepted = 0
    while accepted < proposed and rng.random() < chance:
        accepted += 1
    return accepted


def speedup(batch: int, chance: float, slope: float, *, reach: int, draft_ratio: float = 0.0, model: bool = False,
            rounds: int = 400, c0: float = 0.3, seed: int = 0) -> float:
    """Tokens per second of the planner in the simulated world, over those of plain steps."""
    planner = AdaptiveLength(max_k=10, draft_ratio=draft_ratio)
    rows = [Sequence(i, [1, 2, 3], 10**9) for i in range(batch)]
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(rounds):
        lookups = 0 if model else reach
        lengths = planner.lengths(rows, Reach([lookups] * batch, model=model, first=[7] * batch), False)
        k = max(lengths)
        forwards = k if model else 0
        accepted = [accepted_chain(rng, n, chance) for n in lengths]
        cost = c0 * (1 + slope * k + draft_ratio * forwards)
        shadow = [None if n or model else rng.random() < chance for n in lengths]
        looked = [[not model] * (k + 1)] * batch
        planner.observe(rows, RoundRecord(lengths, accepted, looked, shadow, k, forwards, cost))
        tokens += sum(a + 1 for a in accepted)
        seconds += cost
    return (tokens / seconds) / (batch / c0)


@pytest.mark.parametrize("chance", [0.0, 0.15, 0.4])
def test_where_lookups_cannot_pay_at_b8_plain_steps_keep_the_pace(chance):
    """B = 8 on the CPU: an extra column costs half a plain step, so drafts accepted 40% of the time or less lose."""
    assert speedup(8, chance, slope=0.5, reach=5) >= 0.97


def test_where_a_draft_model_cannot_pay_plain_steps_keep_the_pace():
    """A draft forward at a third of a target step and 25% acceptance: no K pays at B = 8."""
    assert speedup(8, 0.25, slope=0.5, reach=10, draft_ratio=0.33, model=True) >= 0.97


def test_long_lookups_that_are_accepted_pay_at_b1():
    """B = 1: ten columns cost little more than one, so accepted lookups are taken in long runs."""
    assert speedup(1, 0.8, slope=0.02, reach=10) >= 3.0


def test_accepted_lookups_still_pay_at_b8():
    """B = 8 with 90% acceptance: the best K (about 3) gains ~1.38x; the planner finds most of it."""
    assert speedup(8, 0.9, slope=0.5, reach=5) >= 1.25


def test_wrong_lookups_cost_almost_nothing_at_b1():
    assert speedup(1, 0.0, slope=0.02, reach=10) >= 0.97


def test_fixed_and_whole_prefill_budgets():
    assert ChunkBudget(64).limit(3) == 64
    assert ChunkBudget(None).limit(1) is None


def test_auto_prefill_chunk_takes_about_one_decode_round():
    """Decode rounds of 0.06 s and 2.5 ms per prompt token: one new row reads 24 columns, two read 12 each,
    never fewer than the minimum; before anything is timed the first chunk is small."""
    budget = ChunkBudget("auto")
    assert budget.limit(1) == FIRST_AUTO_CHUNK
    budget.decoded(0.06)
    budget.read(tokens=32, seconds=0.08)
    assert budget.limit(1) == 24
    assert budget.limit(2) == 12
    assert budget.limit(8) == MIN_AUTO_CHUNK
    budget.read(tokens=24, seconds=0.12)  # reading got slower (longer context): smaller chunks
    assert budget.limit(1) < 24
