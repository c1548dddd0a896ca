"""The adaptive draft-length planner and the chunked-prefill budget, in simulated worlds with known costs.

The planner is driven round after round by a simulator whose forward costs follow the shape measured on 2 CPU
cores (a round costs ``c_0 (1 + slope K)``: slope ~0.5 at B = 8, ~0.02 at B = 1) and whose drafts are accepted
with a known chance. Its realised tokens per second are compared with plain steps (``B / c_0``): where
speculation cannot pay it must stay within 3% of them, and where it pays it must find most of the gain.
"""

from __future__ import annotations

import random

import pytest
import tiny_models
from helpers import engine_for

from batchspec.config import SpecConfig
from batchspec.engine import draft_length
from batchspec.engine.draft_length import (
    KNEE_TOKENS,
    OVERRUN_KEPT,
    OVERRUN_LEAST,
    AdaptiveLength,
    Overrun,
    Reach,
    RoundRecord,
    prior_slope,
)
from batchspec.engine.prefill import FIRST_AUTO_CHUNK, MIN_AUTO_CHUNK, ChunkBudget, length_groups
from batchspec.engine.schedulers.batches import Batches
from batchspec.engine.state import KVLocation, Sequence
from batchspec.model_checks import Mixture, mixture_of


def accepted_chain(rng: random.Random, chances: list[float]) -> int:
    """Drafts accepted of ``len(chances)``, the ``j``-th accepted with ``chances[j]`` once the ones before it were."""
    accepted = 0
    while accepted < len(chances) and rng.random() < chances[accepted]:
        accepted += 1
    return accepted


def speedup(batch: int, chance: float | list[float], slope: float, *, reach: int,
            model_chance: float | tuple[float, float] | None = None,
            lookup_rows: int | None = None, draft_cost: float = 0.0, draft_ratio: float = 0.0,
            rounds: int = 400, c0: float = 0.3, seed: int = 0, ragged: bool = False,
            realign: float = 0.0, per_row: bool = False, told_per_row: bool | None = None,
            model_prior: float | None = None, margin: float = 1.0, hidden: float = 0.0) -> float:
    """Tokens per second of the planner in the simulated world, over those of plain steps.

    ``lookup_rows`` rows (default all) find ``reach`` lookup drafts accepted with ``chance`` (or row ``i``'s with
    ``chance[i]``); with ``model_chance`` a draft model proposes every other position, accepted with that chance (a
    pair: its first draft's, then the others'), for ``draft_cost * c0`` seconds a forward while the planner's prior
    takes a forward for ``draft_ratio * c0``. A round costs ``c0 (1 + slope K)``, or, ``ragged`` (each row scored
    over its own drafts), ``c0 (1 + slope sum(n) / B)``; the round after one whose rows gained unequally first
    realigns them for ``realign * c0``. ``per_row``: the draft model runs one row at a time (a draft of another
    tokenizer), each row's forward for ``draft_cost * c0``; the planner is told so unless ``told_per_row`` is False.
    ``margin``: the planner's :class:`~batchspec.engine.draft_length.CostFit` margin at several rows (1: this world's
    prices are the ones it fits); ``hidden``: seconds (in ``c0``) a round with drafts costs that its record does not
    show."""
    told = per_row if told_per_row is None else told_per_row
    model = model_chance is not None
    model_first, model_later = model_chance if isinstance(model_chance, tuple) else (model_chance, model_chance)
    chances = chance if isinstance(chance, list) else [chance] * batch
    planner = AdaptiveLength(max_k=10, draft_ratio=draft_ratio, ragged=ragged, model_prior=model_prior, margin=margin)
    rows = [Sequence(i, [1, 2, 3], 10**9) for i in range(batch)]
    lookups = [reach if i < (batch if lookup_rows is None else lookup_rows) else 0 for i in range(batch)]
    rng = random.Random(seed)
    tokens = seconds = moving = 0.0
    for _ in range(rounds):
        first = [7 if n else None for n in lookups]
        lengths = planner.lengths(rows, Reach(lookups, uses_draft_model=model, first=first, per_row=told), False)
        k = max(lengths)
        forwards = k if any(n > looked for n, looked in zip(lengths, lookups, strict=True)) else 0
        if per_row:
            forwards = sum(max(0, n - looked) for n, looked in zip(lengths, lookups, strict=True))
        accepted = [accepted_chain(rng, [p if j < looked else model_first if j == looked else model_later
                                     for j in range(n)])
                    for n, looked, p in zip(lengths, lookups, chances, strict=True)]
        drafting = draft_cost * c0 * forwards
        cost = c0 * (1 + slope * (sum(lengths) / batch if ragged else k)) + drafting
        shadow = [None if n or not looked else rng.random() < p
                  for n, looked, p in zip(lengths, lookups, chances, strict=True)]
        looked = [[j < n for j in range(k + 1)] for n in lookups]
        planner.observe(rows, RoundRecord(lengths, accepted, looked, shadow, k, forwards, cost, drafting, moving))
        tokens += sum(a + 1 for a in accepted)
        seconds += cost + moving + hidden * c0 * (sum(lengths) > 0)
        moving = realign * c0 if len(set(accepted)) > 1 else 0.0
    return (tokens / seconds) / (batch / c0)


def test_a_draft_models_first_guess_and_the_ones_after_it_are_priced_apart():
    """B = 1, a draft step at 0.2 plain steps whose first draft is accepted 95% of the time and the ones after it 30%
    (SpecBench's shape: 0.69-0.88 and 0.48-0.60 with the preset pair). The best fixed K is 1: (1 + 0.95) / (1.02 +
    0.2) = 1.60x plain (K = 2: 1.55x). Priced at one pooled share, the planner drafted more a round, for 1.51-1.53x
    over these four seeds."""
    rates = [speedup(1, 0.0, slope=0.02, reach=0, model_chance=(0.95, 0.3), draft_cost=0.2, draft_ratio=0.2,
                     seed=seed) for seed in range(4)]
    assert min(rates) >= 1.56


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("chance", [0.0, 0.15, 0.4])
def test_where_lookups_cannot_pay_at_b8_plain_steps_keep_the_pace(chance, ragged):
    """B = 8 on the CPU: an extra column costs half a plain step, so drafts accepted 40% of the time or less lose."""
    assert speedup(8, chance, slope=0.5, reach=5, ragged=ragged) >= 0.97


def test_a_ragged_verification_lets_the_rows_that_accept_draft_beside_those_that_do_not():
    """B = 8, two rows whose lookups are accepted 90% of the time beside six whose never are. Scored over the widest
    row's drafts, any K makes every row pay for the two (K = 1 costs 1.5 plain steps for 1.9 of 8 rows' gains): plain
    steps are best. Ragged, the two alone draft (five drafts each for 0.31 plain steps of the batch's cost, 3.7
    tokens each): about 1.18x."""
    chances = [0.9, 0.9] + [0.0] * 6
    assert speedup(8, chances, slope=0.5, reach=5) <= 1.02
    assert speedup(8, chances, slope=0.5, reach=5, ragged=True) >= 1.12


@pytest.mark.parametrize("chance", [0.3, 0.5])
def test_the_realignment_that_unequal_gains_cost_is_priced(chance):
    """Ragged B = 8, each row's drafts accepted 30-50% of the time: the verification alone would pay for the best
    of them (a draft costs 1/16 of a step), but rows then gain unequally and the next round realigns them for half a
    step. Measured and priced, speculation stays close to plain steps; unpriced, it ran at 0.74-0.91x of them."""
    assert speedup(8, chance, slope=0.5, reach=5, ragged=True, realign=0.5) >= 0.97


@pytest.mark.parametrize("batch", [4, 8])
def test_a_draft_that_runs_row_by_row_is_priced_by_its_rows(batch, monkeypatch):
    """A draft of another tokenizer runs one row at a time, each row's forward at a tenth of a plain step of the
    batch, its drafts accepted 90% then 70% of the time. At B = 4 and 8 (an extra column at 1/8 and 1/16 of a step)
    priced by the rows that draft, it stays at plain steps' pace or above; at B = 8, priced as one forward for the
    batch (and no ledger to stop it), the planner drafts for every row and loses (0.82x)."""
    world = dict(slope=0.5, reach=0, model_chance=(0.9, 0.7), draft_cost=0.1, draft_ratio=0.1, ragged=True,
                 per_row=True)
    assert speedup(batch, 0.0, **world) >= 0.99
    if batch == 8:
        monkeypatch.setattr(draft_length, "LEDGER_SHARE", 1e9)  # a loss never pauses drafting
        assert speedup(batch, 0.0, **world, told_per_row=False) < 0.9


@pytest.mark.parametrize("batch", [4, 8])
def test_the_ledger_stops_drafts_that_lose_whatever_the_planner_expected_of_them(batch, monkeypatch):
    """The same world, the planner told the draft runs once for the batch: it expects every row's drafts to pay, and
    they lose (B = 8: 0.82x without the ledger). The ledger measures what the drafted rounds earned and pauses
    drafting while they lost more than LEDGER_SHARE of the time: within 3% of plain steps over 400 rounds (the first
    round that loses is the planner's to price: the ledger bounds what follows it)."""
    world = dict(slope=0.5, reach=0, model_chance=(0.9, 0.7), draft_cost=0.1, draft_ratio=0.1, ragged=True,
                 per_row=True, told_per_row=False)
    assert min(speedup(batch, 0.0, **world, seed=seed) for seed in range(3)) >= 0.96
    if batch == 8:
        monkeypatch.setattr(draft_length, "LEDGER_SHARE", 1e9)
        assert speedup(batch, 0.0, **world) < 0.9


def test_the_ledger_keeps_drafts_that_pay_and_leaves_one_row_alone():
    """Rounds that draft and earn keep the balance above the line (lookups accepted 70% of the time at B = 8 still
    pay about 1.3x); one row's rounds are never booked (a lone row's drafts are priced at their seconds, as the
    margin leaves them); a balance below the line pauses drafting at several rows, not at one."""
    assert speedup(8, 0.7, slope=0.3, reach=5, ragged=True) >= 1.2
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True)
    row = Sequence(0, [1, 2, 3], 10**9)
    for _ in range(5):
        planner.observe([row], RoundRecord([3], [3], [[True] * 4], [None], 3, 0, 0.5))
    assert planner.ledger == draft_length.Ledger()
    planner.ledger.observe(1.0, -1.0)
    rows = [Sequence(i, [1, 2, 3], 10**9) for i in range(4)]
    reach = Reach([5] * 4, uses_draft_model=False, first=[7] * 4)
    assert planner.lengths(rows, reach, False) == [0] * 4
    assert planner.lengths([row], Reach([5], uses_draft_model=False, first=[7]), False)[0] > 0


def test_a_ledger_pauses_below_its_line_and_its_loss_fades():
    """Earned -1 s in a round of 1 s: below the line (-LEDGER_SHARE of the seconds); then rounds that earn nothing
    fade the loss until drafting is tried again."""
    ledger = draft_length.Ledger()
    assert ledger.paying
    ledger.observe(1.0, -1.0)
    assert not ledger.paying
    rounds = 0
    while not ledger.paying:
        ledger.observe(1.0, 0.0)
        rounds += 1
    assert 50 < rounds < 500
    ledger.observe(1.0, 0.004)
    assert ledger.paying


def test_a_proposer_that_knows_its_drafts_first_chance_does_not_probe_at_a_loss():
    """B = 4, a draft of another tokenizer at a tenth of a plain step per row, its first draft accepted 55% of the
    time (SmolLM2-135M for the 1.5B target, through text). Primed with the planner's prior for the preset's draft
    (0.7), 40 rounds probe it at a loss (0.96x); primed with its own (0.55), none is drafted and plain steps keep the
    pace."""
    world = dict(slope=0.5, reach=0, model_chance=(0.55, 0.5), draft_cost=0.1, draft_ratio=0.09, ragged=True,
                 per_row=True, rounds=40)
    assert speedup(4, 0.0, **world) < 0.98
    assert speedup(4, 0.0, **world, model_prior=0.55) >= 0.99


def test_a_draft_that_runs_row_by_row_pays_at_b1():
    """B = 1, a draft forward at 0.11 of the target's (SmolLM2-135M for the 1.5B target), its drafts accepted 80%
    then 65% of the time: about 1.6x plain steps."""
    assert speedup(1, 0.0, slope=0.02, reach=0, model_chance=(0.8, 0.65), draft_cost=0.11, draft_ratio=0.11,
                   ragged=True, per_row=True) >= 1.5


def test_where_a_draft_model_cannot_pay_plain_steps_keep_the_pace():
    """A draft forward at 0.55 target steps (the prior guesses 0.33) and 25% acceptance: no K pays at B = 8."""
    assert speedup(8, 0.0, slope=0.5, reach=0, model_chance=0.25, draft_cost=0.55, draft_ratio=0.33) >= 0.97


def test_hybrid_keeps_the_lookups_when_the_draft_model_does_not_pay():
    """Six of eight rows find good lookups, two do not; drafting for those two with a poor draft model would make
    every drafted position a draft forward for the batch. Hybrid must do about as well as the lookups alone."""
    lookups_alone = speedup(8, 0.9, slope=0.5, reach=5, lookup_rows=6)
    hybrid = speedup(8, 0.9, slope=0.5, reach=5, lookup_rows=6, model_chance=0.3, draft_cost=0.55, draft_ratio=0.33)
    assert lookups_alone >= 1.1
    assert hybrid >= 0.95 * lookups_alone


@pytest.mark.parametrize(("batch", "step", "drafts"), [(8, 0.06, False), (1, 0.03, True)])
def test_a_first_lookup_is_priced_as_prose_accepts_it_before_any_was_tested(batch, step, drafts):
    """Before any lookup was tested, a row's first is priced at what SpecBench's prose accepts (0.17-0.23; 0.3 is
    the prior), not at a draft model's first guess: at B = 8 (a plain step of 60 ms, a column 1/16 of it, as measured
    on writing with the int8 preset) it is not worth its column, so rows whose lookups would be wrong cost what plain
    steps cost from the first round; at B = 1 (30 ms, and a column almost free) it is."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True)
    rows = [Sequence(i, [1, 2, 3], 64) for i in range(batch)]
    planner.observe(rows, RoundRecord([0] * batch, [0] * batch, [[False]] * batch, [None] * batch, 0, 0, step))
    lengths = planner.lengths(rows, Reach([5] * batch, uses_draft_model=False, first=[7] * batch), False)
    assert any(lengths) == drafts, lengths


def test_long_lookups_that_are_accepted_pay_at_b1():
    """B = 1: ten columns cost little more than one, so accepted lookups are taken in long runs."""
    assert speedup(1, 0.8, slope=0.02, reach=10) >= 3.0


@pytest.mark.parametrize("ragged", [False, True])
def test_accepted_lookups_still_pay_at_b8(ragged):
    """B = 8 with 90% acceptance: the best K (about 3) gains ~1.38x; the planner finds most of it."""
    assert speedup(8, 0.9, slope=0.5, reach=5, ragged=ragged) >= 1.25


def test_wrong_lookups_cost_almost_nothing_at_b1():
    assert speedup(1, 0.0, slope=0.02, reach=10) >= 0.97


def test_fixed_and_whole_prefill_budgets():
    assert ChunkBudget(64).limit(3) == 64
    assert ChunkBudget(None).limit(1) is None


def test_auto_prefill_chunk_takes_about_one_decode_round():
    """Plain decode steps of 0.06 s and 2.5 ms per prompt token: one new row reads 24 columns, two read 12 each,
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


def test_a_prompt_chunk_is_sized_by_the_plain_step_not_by_the_rounds_drafts():
    """B = 8, rounds that verify drafts cost more than a plain step (0.3 s, and half of it again per draft column a
    row): the planner's plain step, from which a prompt's chunk is sized, stays near 0.3 s whatever the rounds
    drafted, so a long round does not also read a long chunk; before a round of that size was seen it is the round's
    own seconds."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0)
    rows = [Sequence(i, [1, 2, 3], 10**6) for i in range(8)]
    assert planner.plain_step_s(8, 0.7) == 0.7
    for k in (0, 3, 2, 0, 4, 1, 3, 0, 2, 5) * 4:
        seconds = 0.3 * (1 + 0.5 * k)
        planner.observe(rows, RoundRecord([k] * 8, [0] * 8, [[False] * (k + 1)] * 8, [None] * 8, k, 0, seconds))
        assert planner.plain_step_s(8, seconds) == pytest.approx(0.3, rel=0.15)


@pytest.mark.parametrize(("lag", "budget", "drafts"), [(0, 16, True), (1999, 16, False), (1999, 2000, True)])
def test_an_idle_draft_pays_its_catch_up_before_it_drafts(lag, budget, drafts):
    """B = 1, a draft forward at 0.1 plain steps, 60% acceptance: drafting pays, unless the draft must first read
    a 2,000-token prompt (1 ms a column, from the target's measured 10 ms and the draft's 10% share) for a row
    with 16 tokens left; with 2,000 tokens left the catch-up is spread over CATCH_UP_ROUNDS rounds and pays again."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    planner.read(1000, 10.0, draft=False)
    row = Sequence(0, [1] * 2000, budget)
    planner.observe([row], RoundRecord([0], [0], [[False]], [None], 0, 0, 0.25))
    lengths = planner.lengths([row], Reach([0], uses_draft_model=True, lag=[lag]), False)
    assert (lengths[0] > 0) == drafts, lengths


def _ended(planner: AdaptiveLength, lengths: list[int], reason: str) -> None:
    """Rows of these ``lengths`` finish (``reason``) in one observed round of one row each."""
    for length in lengths:
        row = Sequence(0, [1, 2, 3], 2000)
        row.output.extend([5] * length)
        row.finish_reason = reason
        planner.observe([row], RoundRecord([0], [0], [[False]], [None], 0, 0, 0.25))
        planner.decoded += length - 1  # the tokens it gained before this round


def test_a_draft_does_not_catch_up_a_row_that_ends_as_its_like_did():
    """B = 1, the draft 1 ms a column (a tenth of the target's 10 ms), a row of 40 tokens with 1,960 left whose
    draft lacks 1,999 columns: with its budget ahead it catches up (the previous test); where six rows ended at EOS
    after 20-45 tokens the row is expected to end within a few tokens, and the catch-up is not paid. Rows that ran
    to their budget leave the budget as the horizon."""
    for reason, drafts in (("eos", False), ("length", True)):
        planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
        planner.read(1000, 10.0, draft=False)
        _ended(planner, [20, 25, 30, 35, 40, 45], reason)
        row = Sequence(0, [1] * 2000, 2000)
        row.output.extend([5] * 40)
        lengths = planner.lengths([row], Reach([0], uses_draft_model=True, lag=[1999]), False)
        assert (lengths[0] > 0) == drafts, (reason, lengths)
    assert planner._expected_left([row]) == row.remaining
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    _ended(planner, [20, 25, 30, 35, 40, 45], "eos")
    assert planner._expected_left([row]) < 16
    row.output[:] = [5] * 10
    assert planner._expected_left([row]) > planner._expected_left([Sequence(0, [1], 2000, output=[5] * 40)])
    beyond = Sequence(0, [1], 2000, output=[5] * 46)  # longer than every finished row: no row was seen to go on
    assert planner._expected_left([beyond]) <= draft_length.TAIL_PRIOR_TOKENS


def test_the_chance_a_token_ends_a_row_stays_right_past_the_finished_rows_kept():
    """A long-running engine (the server) keeps the lengths of its last ENDED_KEPT finished rows only, but the chance
    that a token ends a row over all tokens counts every row that ended and every token, so that it does not fall as
    tokens keep being counted while the rows kept stay as many. 200 rows ended at EOS after 20 tokens, then one after
    100: a row of 50 tokens has one kept row that went on past it (50 tokens past), so its chance is
    (1 + 4 * 201 / 4100) / (50 + 4) and it is expected (1 - (1 - chance)^1950) / chance more tokens."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    _ended(planner, [20] * 200 + [100], "eos")
    assert len(planner.ended) == draft_length.ENDED_KEPT
    row = Sequence(0, [1, 2, 3], 2000)
    row.output.extend([5] * 50)
    tail = draft_length.TAIL_PRIOR_TOKENS
    chance = (1 + tail * 201 / 4100) / (50 + tail)
    assert planner._expected_left([row]) == pytest.approx((1 - (1 - chance) ** 1950) / chance)


def test_a_catch_up_is_spread_over_a_few_rounds_however_long_the_answer(monkeypatch):
    """A draft that stops soon after its catch-up has paid all of it: a 4,000-column catch-up (4 s) is spread over
    CATCH_UP_ROUNDS rounds (0.25 s each, as much as the plain step), not over the 100,000 tokens the row has left.
    The draft's first guess is priced at 60% before any was tested."""
    monkeypatch.setitem(draft_length.FIRST_PRIOR, "model", 0.6)
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    planner.read(1000, 10.0, draft=False)
    row = Sequence(0, [1] * 4000, 100_000)
    planner.observe([row], RoundRecord([0], [0], [[False]], [None], 0, 0, 0.25))
    assert planner.lengths([row], Reach([0], uses_draft_model=True, lag=[3999]), False) == [0]
    assert planner.lengths([row], Reach([0], uses_draft_model=True, lag=[0]), False)[0] > 0


def test_the_draft_measured_reading_replaces_the_prior():
    """Once the draft has read columns itself, its own seconds per column price the catch-up."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    planner.read(1000, 10.0, draft=False)
    row = Sequence(0, [1] * 2000, 16)
    planner.observe([row], RoundRecord([0], [0], [[False]], [None], 0, 0, 0.25))
    planner.read(1000, 0.01, draft=True)  # 10 us a column: 2,000 columns cost 20 ms
    assert planner.lengths([row], Reach([0], uses_draft_model=True, lag=[1999]), False)[0] > 0


def test_a_round_whose_draft_caught_up_times_the_catch_up_not_the_draft_step():
    """B = 1, a draft step at 0.1 plain steps, 60% acceptance. The draft's first round also reads 200 columns it
    lacked (a first forward 201 columns wide: 1 s, at 5 ms a column). Booked as a draft step, it would price every
    later step at 1 s and the draft would never run again; instead the step keeps its price and the catch-up's
    columns get theirs (1 s less the step's 0.025 s, over the 200 columns past the step's one: 5 ms, as read).

    A short catch-up is priced alike: 15 columns wide (14 past the step's, 3 past the 12 a round re-reads) at the same
    5 ms, its column costs 5 ms, not 14 / 3 times that."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    row = Sequence(0, [1] * 200, 1000)
    planner.observe([row], RoundRecord([0], [0], [[False]], [None], 0, 0, 0.25))
    planner.observe([row], RoundRecord([1], [1], [[False, False]], [None], 1, 1, 1.25 + 0.025, 1.025,
                                       draft_width=201))
    assert planner.read_s[True] == pytest.approx(1.0 / 200)
    assert planner.lengths([row], Reach([0], uses_draft_model=True, lag=[1]), False)[0] > 0
    planner.observe([row], RoundRecord([1], [1], [[False, False]], [None], 1, 1, 0.3, 0.05, draft_width=2))
    assert planner.fits[1].draft_s == pytest.approx(0.05)
    step = planner.fits[1].draft(1)
    planner.observe([row], RoundRecord([1], [1], [[False, False]], [None], 1, 1, 0.3 + 0.07, step + 0.07,
                                       draft_width=15))
    assert planner.read_s[True] == pytest.approx(0.005)


def test_length_groups_bound_each_rows_padding():
    rows = [Sequence(i, [1] * (n + 1), 8) for i, n in enumerate([43, 208, 51, 68, 57, 52])]
    groups = length_groups(rows, spread=16)
    assert [[row.content_len - 1 for row in group] for group in groups] == [[208], [68, 57, 52], [51, 43]]
    assert [[row.content_len - 1 for row in group] for group in length_groups(rows, spread=200)] == [
        [208, 68, 57, 52, 51, 43]]


def test_a_row_that_holds_columns_joins_only_a_group_that_lacks_as_many():
    """A forward keeps one column count for all its rows: a row holding a prefix (or a part of its prompt read) that
    joined a group lacking more would re-read what it holds, so it reads with rows lacking as many, or alone."""
    rows = [Sequence(i, [1] * (n + 1), 8) for i, n in enumerate([43, 208, 51, 68, 57, 52])]
    rows[4].kv = KVLocation(None, 0, start=0, target_cached=20, draft_cached=0)  # lacks 37 of its 57
    rows[3].kv = KVLocation(None, 0, start=0, target_cached=31, draft_cached=0)  # lacks 37 of its 68
    groups = length_groups(rows, spread=16)
    assert [[row.content_len - 1 for row in group] for group in groups] == [[208], [52, 51, 43], [68, 57]]
    width = max(row.content_len for row in groups[-1])  # left-padded to it, each row's held columns end alike:
    assert len({width - row.content_len + row.kv.target_cached for row in groups[-1]}) == 1  # none re-read


def makespan(chances: list[float], *, draining: bool, batches: int = 4, budget: int = 64, c0: float = 0.3,
             seed: int = 0) -> float:
    """Seconds of ``batches`` offline batches, one after another, each lasting until the last of its
    ``len(chances)`` rows has its ``budget`` of tokens; row ``i`` finds 5 lookups a round, accepted with
    ``chances[i]``, and is scored over its own drafts. A round over the ``B`` rows still running costs
    ``c0 (1/2 + (B + sum n) / 16)``: at B = 8 on 2 CPU cores half of a plain step reads the weights and each column
    scored costs a sixteenth of it."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True, margin=1.0)  # this world's prices are exact
    rng = random.Random(seed)
    seconds = 0.0
    for _ in range(batches):
        rows = [Sequence(i, [1, 2, 3], budget) for i in range(len(chances))]
        while running := [row for row in rows if not row.finished]:
            lookups = [5] * len(running)
            reach = Reach(lookups, uses_draft_model=False, first=[7] * len(running))
            lengths = planner.lengths(running, reach, False, draining=draining)
            accepted = [accepted_chain(rng, [chances[row.index]] * n) for row, n in zip(running, lengths, strict=True)]
            shadow = [None if n else rng.random() < chances[row.index] for row, n in zip(running, lengths, strict=True)]
            looked = [[True] * (max(lengths) + 1) for _ in running]
            for row, a in zip(running, accepted, strict=True):
                row.append([7] * (a + 1), frozenset())
            cost = c0 * (0.5 + (len(running) + sum(lengths)) / 16)
            planner.observe(running, RoundRecord(lengths, accepted, looked, shadow, max(lengths), 0, cost))
            seconds += cost
    return seconds


def test_a_draining_batch_drafts_only_for_the_rows_with_the_most_left(monkeypatch):
    """An offline batch of rows that run to their budget ends when its last row does: a row far ahead of the others
    is worth about the column its token would take later, so it proposes nothing, while the row with the most left
    drafts for the batch. A first lookup is priced at 60% before any was tested."""
    monkeypatch.setitem(draft_length.FIRST_PRIOR, "lookup", 0.6)
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True)
    planner.finished = (20, 20)  # the rows finished so far all ran to their budget
    rows = [Sequence(i, [1, 2, 3], 64) for i in range(4)]
    for row in rows[1:]:
        row.output.extend([7] * 30)
    reach = Reach([5] * 4, uses_draft_model=False, first=[7] * 4)
    assert all(planner.lengths(rows, reach, False))
    draining = planner.lengths(rows, reach, False, draining=True)
    assert draining[0] >= 3
    assert draining[1:] == [0, 0, 0]
    planner.finished = (0, 20)  # rows that end at EOS: any of them may turn out the longest, every token counts
    assert planner.lengths(rows, reach, False, draining=True) == planner.lengths(rows, reach, False)


def test_a_finished_row_makes_room_for_the_next_prompt_and_the_batch_drains_once_none_waits():
    """Offline, a row that ends frees its place for the next prompt in order before the next round, so a row that
    speculation ends sooner gains the run its tokens; the batch drains (no row takes an ended row's place) only once
    no prompt waits. Online it never drains: a request may come at any time."""
    batches = Batches(2)
    rows = [Sequence(i, [1, 2, 3], 4) for i in range(4)]
    for row in rows:
        batches.add(row)
    assert [row.index for row in batches.select()] == [0, 1] and not batches.draining
    rows[1].append([7] * 4, frozenset())
    assert batches.ran(rows[:2]) == [rows[1]]
    assert [row.index for row in batches.select()] == [0, 2] and not batches.draining
    rows[0].append([7] * 4, frozenset())
    batches.ran(rows[:3])
    assert [row.index for row in batches.select()] == [2, 3] and batches.draining
    online = Batches(2, online=True)
    online.add(rows[3])
    assert online.select() == [rows[3]] and not online.draining


def test_a_draining_batch_is_not_slowed_by_the_rows_that_accept(monkeypatch):
    """B = 8, four rows whose lookups are accepted 90% of the time beside four whose are accepted 10%: the batch
    lasts as long as the slow rows, whatever the fast ones gain. Drafting for every token's worth (as while finished
    rows are replaced) makes each of those rounds dearer and the batch slower than plain steps; valued by how much
    sooner they end the batch, the drafts keep it within 3% of plain steps (a first lookup priced at 60% before any
    was tested)."""
    monkeypatch.setitem(draft_length.FIRST_PRIOR, "lookup", 0.6)
    chances = [0.9] * 4 + [0.1] * 4
    plain = 4 * 64 * 0.3 * (0.5 + 8 / 16)
    assert makespan(chances, draining=False) > 1.05 * plain
    assert makespan(chances, draining=True) <= 1.03 * plain


def test_a_draining_batch_whose_rows_all_accept_still_drafts_for_all():
    """B = 8, every row's lookups accepted 90% of the time: the rows finish together only if they all draft, and
    valued by how much sooner they end the batch they do (0.79 of plain steps' time, as while rows are replaced)."""
    plain = 4 * 64 * 0.3 * (0.5 + 8 / 16)
    assert makespan([0.9] * 8, draining=True) <= 0.85 * plain


def _union(experts: int, top_k: int, tokens: int) -> float:
    """Experts ``tokens`` tokens routed uniformly and independently, ``top_k`` each, run on average."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40])
def test_a_mixtures_extra_token_is_priced_by_the_union_of_its_experts(rows):
    """The prior per extra token of a mixture (8 experts, top 2, the experts 0.65 of a one-token forward's weights):
    the dense slope plus the chord of the expected experts' bytes, from a plain step's B tokens to the widest
    verification's B (1 + max_k), over a plain step's bytes; the planner's fits start from it. It shrinks toward
    the dense slope as the B tokens of a plain step run every expert already; a dense target's is the dense slope."""
    mixture, max_k = Mixture(8, 2, 0.65), 8
    assert mixture.union(1) == pytest.approx(2.0) and mixture.union(4) == pytest.approx(_union(8, 2, 4))
    assert mixture.weights(1) == pytest.approx(1.0) and mixture.weights(4) == pytest.approx(2.127, abs=1e-3)
    weights = [1 - 0.65 + 0.65 * _union(8, 2, n) / 2 for n in (rows, rows * (1 + max_k))]
    dense = 1 / max(rows, KNEE_TOKENS)
    want = dense + (weights[1] - weights[0]) / (rows * max_k * weights[0])
    assert prior_slope(rows, max_k, mixture) == pytest.approx(want, rel=1e-12)
    assert AdaptiveLength(max_k, 0.0, ragged=True, mixture=mixture)._fit(rows).slope == prior_slope(rows, max_k,
                                                                                                    mixture)
    assert prior_slope(rows, max_k, mixture) > dense
    assert prior_slope(rows + 1, max_k, mixture) - 1 / max(rows + 1, KNEE_TOKENS) < want - dense
    assert prior_slope(rows, max_k, None) == dense == AdaptiveLength(max_k, 0.0)._fit(rows).slope
    draft_share = AdaptiveLength(max_k, 0.3, mixture=mixture)._fit(rows).draft_share  # a dense draft of 0.3
    assert draft_share == pytest.approx(0.3 / weights[0]) and AdaptiveLength(max_k, 0.3)._fit(rows).draft_share == 0.3
    if rows == 1:
        assert want == pytest.approx(0.28, abs=0.005)  # prior_slope's example
    if rows == 40:
        assert want - dense < 1e-3


def test_before_any_round_a_mixture_drafts_fewer_lookups_than_a_dense_target(monkeypatch):
    """B = 1, ten lookups at a first prior of 0.2 (the ones after it too): priced as a dense target's (an extra token
    1/16 of a plain step), drafts pay (one: 1.2 / 1.0625 = 1.13 plain steps' rate); priced by the union of a
    mixture's experts (8, top 2, 0.65 of the weights: 0.25 a token), none do (one: 1.2 / 1.25 = 0.96)."""
    monkeypatch.setitem(draft_length.FIRST_PRIOR, "lookup", 0.2)
    rows = [Sequence(0, [1, 2, 3], 100)]
    reach = Reach([10], uses_draft_model=False, first=[7])
    dense = AdaptiveLength(10, 0.0).lengths(rows, reach, False)
    mixed = AdaptiveLength(10, 0.0, mixture=Mixture(8, 2, 0.65)).lengths(rows, reach, False)
    assert dense[0] > mixed[0] == 0


@pytest.mark.parametrize("build", [tiny_models.build_llama, tiny_models.build_qwen3_moe, tiny_models.build_mixtral])
def test_the_engine_prices_a_target_by_its_experts_once(build):
    """The engine's planner holds the target's mixture (None for a dense one, whose fits start from the dense slope
    bit for bit) and prices every batch size's extra token from it."""
    target = build(seed=3).float()
    engine = engine_for(target, None, SpecConfig(proposer="ngram", num_draft_tokens="auto"))
    planner, mixture = engine.planner, mixture_of(target)
    assert planner.mixture == mixture
    assert (mixture is None) == (build is tiny_models.build_llama)
    for rows in (1, 5, 20):
        slope = planner._fit(rows).slope
        assert slope == (1 / max(rows, KNEE_TOKENS) if mixture is None else prior_slope(rows, planner.max_k, mixture))


@pytest.mark.parametrize("chance", [0.3, 0.4])
def test_several_rows_draft_only_where_drafting_pays_by_the_margin(chance):
    """B = 8, ragged, lookups accepted 30-40% of the time, each extra column at 0.3 of a plain step over the rows
    (break-even at 30%), and every round with drafts costing a tenth of a plain step more than its record shows
    (what rows that gain unequally cost later: KV gathers, prompts read in more chunks). Priced at its fitted seconds
    the planner drafts for gains that the unseen cost eats (0.97-0.98x); at the margin it keeps plain's pace."""
    world = dict(slope=0.3, reach=5, ragged=True, hidden=0.1, realign=0.02)
    assert speedup(8, chance, margin=1.0, **world) < 0.985
    assert speedup(8, chance, margin=draft_length.UNEQUAL_MARGIN, **world) >= 0.99


def test_the_margin_leaves_drafts_that_pay_well_and_one_row_alone():
    """Drafts accepted half of the time at a fifth of a plain step a column still pay at B = 8 with the margin
    (about 1.12x); one row has no other rows to leave unequal, and its drafts are priced at their fitted seconds."""
    assert speedup(8, 0.5, slope=0.2, reach=5, ragged=True, hidden=0.05, margin=draft_length.UNEQUAL_MARGIN) >= 1.08
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1)
    assert planner._fit(1).margin == 1.0
    assert planner._fit(4).margin == draft_length.UNEQUAL_MARGIN > 1.0


def test_a_sources_trust_is_what_its_drafts_gave_of_what_they_were_expected_to():
    """Drafts expected to give 10 tokens gave 6: the source's gains are scaled by (6 + 2) / (10 + 2) (two expected
    tokens taken as borne out); never above 1 where drafts gave more; fading back toward 1 while none is proposed."""
    trust = draft_length.Trust()
    assert trust.factor == 1.0
    trust.observe(10.0, 6)
    assert trust.factor == pytest.approx(8 / 12)
    before = trust.factor
    trust.fade(0.5)
    assert before < trust.factor < 1.0
    better = draft_length.Trust()
    better.observe(2.0, 5)
    assert better.factor == 1.0


def test_a_row_alone_drafts_on_its_own_share_whatever_the_trust():
    """The draft model's factor fell to 0.09 (drafts expected to give 20 tokens gave none): four rows whose first
    draft model guess is priced at 0.7 propose nothing, while a row alone, priced on its own share, still drafts."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1, ragged=True)
    planner.trust["model"].observe(20.0, 0)
    assert planner.trust["model"].factor == pytest.approx(2 / 22)
    assert planner._trust(1) == (1.0, 1.0)
    assert planner._trust(4) == (1.0, pytest.approx(2 / 22))
    four = [Sequence(i, [1, 2, 3], 100) for i in range(4)]
    assert planner.lengths(four, Reach([0] * 4, uses_draft_model=True, lag=[0] * 4), False) == [0] * 4
    assert planner.lengths(four[:1], Reach([0], uses_draft_model=True, lag=[0]), False)[0] > 0


def test_one_rejection_moves_a_row_alone_less_than_a_row_among_others():
    """A row's first draft model guess, rejected once where the engine-wide share is 0.7: among other rows its share
    is (0 + 0.7) / (1 + 1) = 0.35; alone, the engine-wide share (its own longer memory) weighs 4 observations:
    (0 + 4 * 0.7) / (1 + 4) = 0.56."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.1, ragged=True)
    row = Sequence(0, [1, 2, 3], 100)
    row.acceptance.model.first.observe(0, 1, draft_length.ROW_DECAY)
    assert planner._shares(row).model_first == pytest.approx(0.35)
    assert planner._shares(row, alone=True).model_first == pytest.approx(0.56)


def test_overrated_drafts_lose_the_planners_trust_and_are_proposed_less():
    """Rows whose lookups look good (a first lookup checked for free is always right) but whose proposed drafts
    are never accepted: the planner's expected tokens of its proposals are not borne out, and its trust in lookups
    falls, and it proposes less."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True)
    rows = [Sequence(i, [1, 2, 3], 10**9) for i in range(4)]
    reach = Reach([5] * 4, uses_draft_model=False, first=[7] * 4)
    proposed = []
    for _ in range(60):
        lengths = planner.lengths(rows, reach, False)
        proposed.append(sum(lengths))
        shadow = [None if n else True for n in lengths]
        looked = [[True] * (max(lengths) + 1) for _ in rows]
        planner.observe(rows, RoundRecord(lengths, [0] * 4, looked, shadow, max(lengths), 0, 0.3))
    assert planner.trust["lookup"].factor < 0.5
    assert sum(proposed[-20:]) < 0.75 * sum(proposed[:20])


def _wide_lookup_rounds() -> tuple[AdaptiveLength, list[Sequence], Reach]:
    """A planner of 8 rows that has observed rounds of every width up to 8 extra tokens a row, at ``c0 (1 + x / 16)``
    with ``c0`` 0.1 s, every draft accepted; the rows, and a reach of 10 lookups each."""
    planner = AdaptiveLength(max_k=10, draft_ratio=0.0, ragged=True)
    rows = [Sequence(i, [1, 2, 3], 10**9) for i in range(8)]
    reach = Reach([10] * 8, uses_draft_model=False, first=[7] * 8)
    for n in range(12):
        lengths = [n % 9] * 8
        looked = [[True] * (max(lengths) + 1) for _ in rows]
        seconds = 0.1 * (1 + sum(lengths) / 16)
        planner.observe(rows, RoundRecord(lengths, lengths, looked, [None] * 8, max(lengths), 0, seconds))
    return planner, rows, reach


def test_a_capped_round_drafts_no_further_than_its_seconds_allow():
    """B = 8, every row's 10 lookups accepted 90% of the time: uncapped, the planner verifies most of them (a wide
    round, three plain steps long on 2 CPU cores); capped at the seconds a streamed round may take (the server's:
    :meth:`~batchspec.engine.prefill.ChunkBudget.round_cap`), its round's fitted seconds stay within the cap, and
    it still drafts where the cap leaves room."""
    planner, rows, reach = _wide_lookup_rounds()
    fit = planner._fit(8)
    free = planner.lengths(rows, reach, False)
    cap = 1.5 * fit.theta[0]
    capped = planner.lengths(rows, reach, False, cap=cap)
    assert fit.seconds(sum(free), 0) > cap
    assert 0 < sum(capped) < sum(free)
    assert fit.seconds(sum(capped), 0) <= cap
    assert planner.lengths(rows, reach, False, cap=fit.theta[0]) == [0] * 8


def test_the_overrun_is_the_high_quantile_of_drafted_rounds_over_their_plans_and_never_below_one():
    overrun = Overrun()
    for ratio in [1.5] * (OVERRUN_LEAST - 1):
        overrun.observe(ratio)
    assert overrun.factor == 1.0  # too few rounds yet
    overrun.observe(1.5)
    assert overrun.factor == 1.5
    for _ in range(OVERRUN_KEPT):  # the old rounds leave: 9 in 10 on plan, 1 in 10 at 1.4x
        for ratio in [1.0] * 9 + [1.4]:
            overrun.observe(ratio)
    assert overrun.factor == 1.0
    for ratio in [0.7, 1.2] * OVERRUN_KEPT:
        overrun.observe(ratio)
    assert overrun.factor == 1.2
    for ratio in [0.8] * OVERRUN_KEPT:
        overrun.observe(ratio)
    assert overrun.factor == 1.0


def test_a_capped_round_keeps_its_drafts_within_the_cap_over_how_far_drafted_rounds_ran_over():
    """B = 8, 10 lookups a row accepted 90% of the time, every drafted round's seconds its fit's times 0.85, 1 or
    1.25 in turn (a noisy host): capped at 1.5 plain steps, the planner learns how far its plans run over and plans
    within the cap over that, so a round running 1.25x its plan still ends within the cap; where it had not learnt
    it (the factor 1), it drafts more, up to the cap itself."""
    planner, rows, reach = _wide_lookup_rounds()
    cap = 1.5 * planner._fit(8).theta[0]
    for turn in range(3 * OVERRUN_LEAST):
        lengths = planner.lengths(rows, reach, False, cap=cap)
        seconds = planner.planned_s * (0.85, 1.0, 1.25)[turn % 3]
        accepted = [round(0.9 * n) for n in lengths]
        looked = [[True] * (max(lengths) + 1) for _ in rows]
        planner.observe(rows, RoundRecord(lengths, accepted, looked, [None] * 8, max(lengths), 0, seconds))
    fit = planner._fit(8)
    assert planner.overrun.factor > 1.15
    capped = planner.lengths(rows, reach, False, cap=cap)
    assert sum(capped) > 0
    assert fit.seconds(sum(capped), 0) * planner.overrun.factor <= cap
    planner.overrun = Overrun()
    unlearnt = planner.lengths(rows, reach, False, cap=cap)
    assert sum(unlearnt) > sum(capped)
    assert fit.seconds(sum(unlearnt), 0) <= cap


@pytest.mark.parametrize("seed", range(6))
def test_a_round_the_planner_calls_idle_is_one_its_full_pricing_leaves_plain(seed, monkeypatch):
    """The bound that spares pricing every option (``AdaptiveLength._idle``) says no draft can pay only where the full
    pricing proposes nothing: random rows, lookups, draft models, widths, acceptance and timings, round after round,
    in batches that drain (rows of one budget that gain unequally) or not."""
    rng = random.Random(seed)
    batch = rng.choice([2, 4, 8])
    draining = seed % 2 == 1
    planner = AdaptiveLength(max_k=rng.choice([3, 10]), draft_ratio=rng.choice([0.0, 0.1, 0.3]),
                             ragged=rng.random() < 0.5, margin=rng.choice([1.0, draft_length.UNEQUAL_MARGIN]))
    budgets = [rng.choice([64, 300])] * batch if draining else [rng.choice([2, 64, 10**6]) for _ in range(batch)]
    rows = [Sequence(i, [1, 2, 3], budget) for i, budget in enumerate(budgets)]
    model = rng.random() < 0.5
    chance = rng.random()
    said = []
    bound = AdaptiveLength._idle
    monkeypatch.setattr(AdaptiveLength, "_idle", lambda self, *args: said.append(bound(self, *args)) or said[-1])
    idle_rounds = busy_rounds = 0
    for _ in range(120):
        lookups = [rng.choice([0, 0, 1, 3, 8]) for _ in rows]
        reach = Reach(lookups, uses_draft_model=model, first=[7 if n else None for n in lookups])
        said.clear()
        bounded = planner.lengths(rows, reach, False, draining=draining)
        idle = said == [True]
        with monkeypatch.context() as full:
            full.setattr(AdaptiveLength, "_idle", lambda self, *args: False)
            lengths = planner.lengths(rows, reach, False, draining=draining)
        if idle:
            assert bounded == lengths == [0] * batch
        else:
            assert bounded == lengths
        idle_rounds += idle
        busy_rounds += any(lengths)
        k = max(lengths)
        accepted = [accepted_chain(rng, [chance] * n) for n in lengths]
        looked = [[j < n for j in range(k + 1)] for n in lookups]
        seconds = 0.1 * (1 + rng.uniform(0.02, 0.5) * sum(lengths) / batch) * rng.uniform(0.9, 1.1)
        shadow = [None if n or not found else rng.random() < chance for n, found in zip(lengths, lookups, strict=True)]
        planner.observe(rows, RoundRecord(lengths, accepted, looked, shadow, k, k if model else 0, seconds,
                                          0.01 * k if model else 0.0))
        for row, a in zip(rows, accepted, strict=True):  # rows gain unequally, and none finishes
            row.output.extend([5] * min(a + 1, max(row.remaining - 1, 0)))
    assert idle_rounds > 0 and busy_rounds > 0  # both kinds of round were checked


def test_one_noisy_round_of_few_extra_tokens_leaves_the_slope_near_its_prior_and_wide_rounds_teach_it():
    """A shared host's plain rounds spread by 5-8%, more than one extra verified token costs at several rows: one
    round of one extra token that ran 8% under the plain step must not fit a free verification (it did with the
    prior at its least weight: the next round verified 10 lookups for each of 7 rows, 4.5 plain steps long), while
    rounds of dozens of extra tokens measure the slope. Where the plain rounds do not spread, the same round does teach
    the slope."""
    c0, true_slope = 0.08, 0.003  # seconds: a plain step of 8 rows and what one more verified token adds
    after_one_round = {}
    for spread in (0.06, 0.0):
        fit = AdaptiveLength(max_k=10, draft_ratio=0.3, ragged=True)._fit(8)
        for i in range(40):
            fit.observe(0, 0, c0 * (1 + spread * (-1) ** i), 0.0)
        fit.observe(1, 0, 0.92 * c0, 0.0)
        after_one_round[spread] = fit.theta[1]
        for _ in range(3):
            fit.observe(40, 0, c0 + 40 * true_slope, 0.0)
        assert fit.theta[1] == pytest.approx(true_slope, rel=0.2)
    prior = c0 / KNEE_TOKENS  # the prior slope at 8 rows, in seconds a token
    assert after_one_round[0.06] > 0.5 * prior
    assert after_one_round[0.0] == 0.0
