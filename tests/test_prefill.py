"""Reading apart from the decoding batch (:mod:`batchspec.engine.prefill`): what one round of the running streams may
carry while a row joins.

A row that joins while the draft is idle has its prompt read by the target alone, in chunks; when the draft next
drafts it must first read that prompt too. Read whole inside a decoding round, it is one long gap for every running
stream (the p99 gap of issue 76): the catch-up is read in chunks as the target's prompt is, and the rows decode
without the draft model until it is done. Every answer stays the target's greedy one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import engine_for, make_prompts_for, reference_greedy

import batchspec.engine.core as core
from batchspec.config import SpecConfig
from batchspec.engine.prefill import ChunkBudget
from batchspec.engine.proposers.draft import DraftModelProposer
from batchspec.engine.realign import draft_catch_up
from batchspec.engine.schedulers import make_scheduler
from batchspec.engine.schedulers.drive import Offline, drive
from batchspec.engine.state import Sequence

CHUNK = 4


class Arrivals(Offline):
    """Driver hooks that queue one row before the first round and the rest ``later`` rounds on, as a server's
    requests arrive while others stream."""

    def __init__(self, rows: list[Sequence], later: int) -> None:
        super().__init__(lambda finished: None)
        self.first, self.rest, self.rounds, self.later = rows[:1], rows[1:], 0, later

    def admit(self, scheduler) -> bool:
        arriving = self.first if self.rounds == 0 else self.rest if self.rounds == self.later else []
        for row in arriving:
            scheduler.add(row)
        self.rounds += 1
        return self.rounds <= self.later or super().admit(scheduler)


class AlwaysDrafts:
    """Stands in for the adaptive planner: after ``idle`` rounds without drafts every row drafts 2 tokens a round
    with the draft model, and new prompts are read by the target alone (``drafting`` False, the planner's own choice:
    see ``AdaptiveLength.read``), so a row that joins lags its whole prompt in the draft's cache."""

    def __init__(self, planner, idle: int) -> None:
        self.planner, self.idle = planner, idle
        planner.drafting = False

    def __call__(self, rows, reach, sampled: bool, *, draining: bool = False, cap: float | None = None) -> list[int]:
        self.idle -= 1
        k = 0 if self.idle >= 0 else 2
        return [reach.available(i, min(k, row.remaining - 1)) for i, row in enumerate(rows)]


class Reads:
    """What the draft read in each round of a run: the columns per row of each catch-up it read alone, and per round
    its forwards and the columns per row of its first forward."""

    def __init__(self, decoder, monkeypatch) -> None:
        self.catch_ups: list[int] = []
        self.forwards: list[int] = []
        self.widths: list[int] = []
        self.steady = decoder.planner.limit + 1  # columns a row's draft may lack after a round in which it ran
        reading, propose = core.catch_up, decoder.proposer.propose

        def counted_catch_up(rows, readers, runner, **read):
            done = reading(rows, readers, runner, **read)
            if all(reader.is_draft for reader in readers):
                self.catch_ups.append(done.tokens.get(True, 0) // len(rows))
            return done

        def counted_propose(batch, plan, sampling, runner):
            proposal = propose(batch, plan, sampling, runner)
            self.forwards.append(proposal.draft_forwards)
            self.widths.append(proposal.draft_width)
            return proposal

        monkeypatch.setattr(core, "catch_up", counted_catch_up)
        decoder.proposer.propose = counted_propose


def _run(bundle, method: str, prompts: list[list[int]], budgets: tuple[int, ...], idle: int, monkeypatch) -> Reads:
    """Row 0 from the first round, the others two rounds later, chunks of ``CHUNK`` columns, the draft idle for
    ``idle`` rounds; every answer must be the target's greedy one."""
    config = SpecConfig(method=method, batch_size=3, num_draft_tokens="auto", proposer="draft", prefill_chunk=CHUNK,
                        eos_token_ids=(bundle.eos_id,), pad_token_id=bundle.pad_id, check_invariants=True)
    decoder = engine_for(bundle.target, bundle.drafts["identical"], config)
    decoder.planner.lengths = AlwaysDrafts(decoder.planner, idle)
    reads = Reads(decoder, monkeypatch)
    rows = [Sequence(i, p, budget) for i, (p, budget) in enumerate(zip(prompts, budgets, strict=True))]
    with torch.inference_mode():
        drive(decoder, make_scheduler(config, online=True), Arrivals(rows, later=2))
    expected = [reference_greedy(bundle.target, p, n, bundle.eos_id) for p, n in zip(prompts, budgets, strict=True)]
    assert [row.output for row in rows] == expected
    return reads


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_a_joining_rows_draft_catch_up_is_read_in_chunks_while_others_decode(method, qwen2, monkeypatch):
    """Row 0 decodes with the draft; rows 1 and 2 (prompts of 30 to 50 tokens) join two rounds later, read by the
    target in chunks of 4 columns. Before the draft drafts again it reads their prompts too, at most 4 columns a row
    in any round (it read all of one at once before: a 49-column catch-up in one round of row 0's stream), and it
    drafts again once they are read; every answer is the target's greedy one."""
    prompts = [make_prompts_for(qwen2, 1, seed=5, min_len=6, max_len=6)[0],
               *make_prompts_for(qwen2, 2, seed=6, min_len=30, max_len=50, specials=False)]
    reads = _run(qwen2, method, prompts, (80, 24, 24), idle=0, monkeypatch=monkeypatch)
    assert len(reads.catch_ups) > 2 and max(reads.catch_ups) <= CHUNK, reads.catch_ups  # several rounds, a chunk each
    drafted = [i for i, n in enumerate(reads.forwards) if n]
    assert drafted and 0 in reads.forwards[drafted[0] :], reads.forwards  # it sat rounds out, then drafted again
    assert reads.forwards[-1] or reads.forwards[-2], reads.forwards


def test_a_draft_idle_for_long_catches_up_in_chunks_before_its_first_forward(qwen2, monkeypatch):
    """The draft is idle for the first 8 rounds, while row 0 streams and rows 1 and 2 join (prompts whose 40 tokens
    hold no EOS): no row's draft holds a column, so none lags, and its first forward read every row's whole text at
    once (as in the longest rounds of a served load: 146 columns a row). Now rows lacking more than a round re-reads
    (the planner's drafts and the pending token) catch up first, at most 4 columns a round, no first forward reads
    more, and the draft then drafts."""
    prompts = [prompt for prompt, _ in qwen2.probe[:3]]
    reads = _run(qwen2, "eqspec", prompts, (40, 40, 40), idle=8, monkeypatch=monkeypatch)
    assert max(reads.widths) <= reads.steady + 1, reads.widths
    assert reads.catch_ups and max(reads.catch_ups) <= CHUNK, reads.catch_ups
    assert max(reads.forwards) > 0, reads.forwards


def test_a_round_that_catches_the_draft_up_apart_drafts_only_where_its_cap_leaves_room(qwen2, monkeypatch):
    """The draft idle for 8 rounds while rows 1 and 2 join, as above, and no round's cap leaving room past its planned
    decoding (``spare_columns`` 0): a round whose draft reads a row's lag apart runs no draft forward (on SpecBench's
    served chats at one client such rounds had read as many columns again in the draft's first forward: 2.7 plain
    steps and more, the p99 gap); once caught up the rows draft, and every answer is the target's greedy one."""
    monkeypatch.setattr(ChunkBudget, "spare_columns", lambda self, rows, decode_s: 0, raising=False)
    rounds: list[tuple[bool, int]] = []  # per decoded round: whether the draft caught up apart, its forwards
    caught = [False]
    reading, propose = core.catch_up, DraftModelProposer.propose

    def marked_catch_up(rows, readers, runner, **read):
        caught[0] |= all(reader.is_draft for reader in readers)
        return reading(rows, readers, runner, **read)

    def paired_propose(self, batch, plan, sampling, runner):
        proposal = propose(self, batch, plan, sampling, runner)
        rounds.append((caught[0], proposal.draft_forwards))
        caught[0] = False
        return proposal

    monkeypatch.setattr(core, "catch_up", marked_catch_up)
    monkeypatch.setattr(DraftModelProposer, "propose", paired_propose)
    prompts = [prompt for prompt, _ in qwen2.probe[:3]]
    _run(qwen2, "eqspec", prompts, (40, 40, 40), idle=8, monkeypatch=monkeypatch)
    assert any(apart for apart, _ in rounds) and any(forwards for _, forwards in rounds), rounds
    assert not any(apart and forwards for apart, forwards in rounds), rounds


def test_a_rounds_spare_columns_are_what_its_cap_leaves_after_its_decoding():
    """Plain steps of 0.06 s, so a round that read no prompt may take 0.12 s; the draft reads a column in 0.5 ms. A
    round planned to decode for 0.08 s leaves 0.04 s: 80 columns for one row, 40 each for two; a plain step's
    decoding leaves 120; a round planned past its cap leaves none. A fixed setting is its columns; unset, no cap."""
    budget = ChunkBudget("auto")
    budget.decoded(0.06)
    budget.read(tokens=32, seconds=0.08)
    budget.begin()
    assert budget.spare_columns(1, 0.08) == 32  # no catch-up timed yet: the first chunk's columns
    budget.caught_up(tokens=100, seconds=0.05)
    budget.begin()
    assert budget.spare_columns(1, 0.08) == 80
    assert budget.spare_columns(2, 0.08) == 40
    assert budget.spare_columns(1, None) == 120
    assert budget.spare_columns(1, 0.2) == 0
    fixed = ChunkBudget(5)
    fixed.decoded(0.06)
    assert fixed.spare_columns(3, 0.08) == 5
    assert ChunkBudget(None).spare_columns(1, 0.08) is None


def test_the_drafts_catch_up_takes_what_the_rounds_prompt_chunk_left():
    """Plain steps of 0.06 s; the target reads a prompt token in 2.5 ms, the draft in 0.5 ms. A draft catching one
    row up reads 120 columns in a round that read no prompt, 60 after a chunk of 0.03 s, and never fewer than the
    minimum; a fixed setting is the same number of columns for both."""
    budget = ChunkBudget("auto")
    budget.decoded(0.06)
    budget.read(tokens=32, seconds=0.08)
    budget.caught_up(tokens=100, seconds=0.05)
    budget.begin()
    assert budget.catch_up_limit(1) == 120
    budget.read(tokens=12, seconds=0.03)
    assert budget.catch_up_limit(1) == 60
    budget.read(tokens=12, seconds=0.05)
    assert budget.catch_up_limit(1) == 8
    assert ChunkBudget(5).catch_up_limit(2) == 5


def test_rows_lacking_more_than_far_catch_up_though_none_lags():
    """Rows whose draft holds nothing (a draft that never ran for them) lag behind no column the batch keeps, so no
    catch-up is asked for, and the draft's first forward would read both whole; with ``far = 5`` the row lacking 9
    columns catches up first, the one lacking 2 does not."""
    rows = [Sequence(0, list(range(10)), 8), Sequence(1, [1, 2, 3], 8)]
    assert draft_catch_up(rows) == ()
    assert draft_catch_up(rows, far=5) == (0,)


def test_a_streamed_rounds_seconds_are_capped_at_a_plain_rounds_worst():
    """A round of plain decoding while prompts stream in takes at most its chunk (about a plain step, auto) and its
    step: a round may decode for that long less what it read already, never less than a plain step; unset (offline),
    or before a step was timed, nothing caps it."""
    assert ChunkBudget(None).round_cap() is None
    budget = ChunkBudget("auto")
    assert budget.round_cap() is None
    budget.decoded(0.1)
    budget.begin()
    assert budget.round_cap() == pytest.approx(0.2)
    budget.read(10, 0.06)
    assert budget.round_cap() == pytest.approx(0.14)
    budget.read(10, 0.2)
    assert budget.round_cap() == pytest.approx(0.1)
    fixed = ChunkBudget(50)
    fixed.decoded(0.1)
    fixed.read(10, 0.01)  # a prompt column read in a millisecond: a chunk of 50 takes 0.05 s
    fixed.begin()
    assert fixed.round_cap() == pytest.approx(0.15)
