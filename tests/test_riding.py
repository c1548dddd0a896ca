"""Prompts read inside the rounds of the rows that decode (:mod:`batchspec.engine.riding`): a riding row feeds its
next prompt tokens as drafts the target keeps by fiat, in the verification forward of the others, instead of a
forward of its own. On the fused integer forward its KV is the bits of a read apart, so every answer must stay the
quantized model's own greedy one (and a seeded row's samples its own), whoever rides beside whom.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import engine_for, reference_greedy
from test_prefill import Arrivals

from batchspec.config import SamplingParams, SpecConfig
from batchspec.engine.core import Engine
from batchspec.engine.errors import InvariantError
from batchspec.engine.prefill import ChunkBudget
from batchspec.engine.riding import Ride
from batchspec.engine.sampling import derive_row_seeds
from batchspec.engine.schedulers import make_scheduler
from batchspec.engine.schedulers.drive import drive
from batchspec.engine.state import Sequence
from batchspec.engine.verifier import Verdict
from batchspec.exact.integer import native, quantize_model
from batchspec.exact.integer.forward import integer_forward

CHUNK = 4


@pytest.fixture(scope="module")
def quantized(bundles) -> tuple:
    """The tiny qwen2 pair in float32, quantized: on the fused integer forward, whose verification is ragged."""
    if not native.available():
        pytest.skip("riding needs the fused integer forward: its native kernels do not run on this CPU or machine")
    bundle = bundles["qwen2"]
    target, draft = (quantize_model(copy.deepcopy(m).float()) for m in (bundle.target, bundle.drafts["perturbed"]))
    if integer_forward(target) is None:
        raise AssertionError("the quantized tiny target runs on the fused integer forward")
    return target, draft, bundle


def _staged(ride: Ride) -> Ride:
    return ride.staged_as(tuple(torch.tensor(column) for column in ride.host_columns()))


def test_a_riding_row_feeds_its_next_prompt_tokens_and_keeps_them_by_fiat():
    """The module's example: prompt ``[5, 9, 2, 7, 4]`` read to 2 (9 pending), 2 columns a round: the row feeds
    ``[9, 2]`` (no logits wanted) and gains ``[2, 7]`` whatever the target says; the row beside it feeds its pending
    token and 2 drafts, and keeps its own verdict. The row reads on to 4, then decodes (its last prompt token
    pending)."""
    rows = [Sequence(0, [5, 9, 2, 7, 4], 8, reading=2), Sequence(1, [3, 3], 8)]
    assert rows[0].content == [5, 9] and rows[0].content_len == 2
    ride = _staged(Ride.of(rows, 2))
    assert ride.columns == [2, 0] and ride.tokens == [[2, 7], []] and ride.riding == [0] and ride.extra == 1
    inputs = torch.tensor([[9, 0, 0], [3, 8, 6]])  # pending, then drafts (row 0 proposes none)
    assert ride.inputs(inputs).tolist() == [[9, 2, 0], [3, 8, 6]]
    assert ride.inputs(inputs[:, :1]).tolist() == [[9, 2], [3, 0]]  # a plain step widens to the ride
    fed = torch.tensor([1, 3])
    assert ride.fed(fed).tolist() == [2, 3] and ride.scored(fed).tolist() == [0, 3]
    verdict = Verdict(accepted=torch.tensor([0, 1]), tokens=torch.tensor([[11, 12, 13], [8, 5, 0]]))
    decided = ride.decided(verdict)
    assert decided.accepted.tolist() == [1, 1] and decided.tokens.tolist() == [[2, 7, 0], [8, 5, 0]]
    plain = ride.decided(Verdict(accepted=torch.tensor([0, 0]), tokens=torch.tensor([[11], [4]])))
    assert plain.accepted.tolist() == [1, 0] and plain.tokens.tolist() == [[2, 7], [4, 0]]
    rows[0].read_on(2)
    assert rows[0].content == [5, 9, 2, 7] and Ride.of(rows, 2).columns == [1, 0]  # never past the last
    rows[0].read_on(1)
    assert rows[0].reading is None and rows[0].content == [5, 9, 2, 7, 4] and Ride.of(rows, 2).columns == [0, 0]
    with pytest.raises(InvariantError):
        rows[0].read_on(1)
    unridden = Ride.of(rows, 2)
    assert unridden.host_columns() == () and unridden.inputs(inputs) is inputs and unridden.scored(fed) is None


def test_a_rounds_budget_goes_to_the_rows_that_came_first():
    """The docstring's examples: riders of 30 and 5 prompt tokens left (the first to come first), a budget of 12:
    11 and 1 columns, whatever their places in the batch; of 6 and 5 left: their prompts' ends; no budget: all."""
    def riders(lefts: list[int], order: list[int]) -> list[Sequence]:
        rows = [Sequence(index, list(range(left + 3)), 8, reading=3) for index, left in zip(order, lefts, strict=True)]
        return [*rows, Sequence(9, [1, 2], 8)]

    assert Ride.of(riders([30, 5], [0, 1]), 12).columns == [11, 1, 0]
    assert Ride.of(riders([5, 30], [1, 0]), 12).columns == [1, 11, 0]
    assert Ride.of(riders([6, 5], [0, 1]), 12).columns == [6, 5, 0]
    assert Ride.of(riders([4, 3], [0, 1]), None).columns == [4, 3, 0]
    assert Ride.of(riders([4, 3], [0, 1]), 1).columns == [1, 1, 0]  # each its pending token at least


def test_the_ride_budget_adds_about_a_plain_step():
    """Plain steps of 0.06 s: at 2.5 ms a column (what a column read apart took, or the fit's, whichever is more)
    24 columns ride; at most 64; a fixed setting is its columns; unset, all."""
    budget = ChunkBudget("auto")
    assert budget.ride_budget(None) == 32  # nothing measured: the first chunk's columns
    budget.decoded(0.06)
    budget.read(tokens=100, seconds=0.25)
    assert budget.ride_budget(0.002) == 24 and budget.ride_budget(None) == 24
    assert budget.ride_budget(0.004) == 15
    fast = ChunkBudget("auto")
    fast.decoded(0.06)
    assert fast.ride_budget(0.0001) == 64
    assert ChunkBudget(5).ride_budget(0.002) == 5 and ChunkBudget(None).ride_budget(0.002) is None


def test_a_row_closed_by_its_ride_proposes_nothing(quantized):
    """A riding row's lookups are the prompt's own, not a text it generates: the planner sees none, and no draft."""
    target, draft, bundle = quantized
    config = SpecConfig(method="eqspec", proposer="hybrid", num_draft_tokens="auto", eos_token_ids=(bundle.eos_id,),
                        pad_token_id=bundle.pad_id)
    engine = engine_for(target, draft, config)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    rows = [Sequence(0, prompt, 8, reading=6), Sequence(1, prompt, 8)]
    ride = Ride.of(rows, 3)
    reach = ride.closed(engine.proposer.reach(rows, 4))
    assert reach.lookups[0] == 0 and reach.lookups[1] > 0
    assert reach.available(0, 4) == 0 and reach.available(1, 4) == 4


def _served(quantized, rows: list[Sequence], chunk: int | None = CHUNK, **settings) -> object:
    """Drive ``rows`` as the server does (the online scheduler, three at a time, chunks of ``chunk`` columns): row 0
    alone in the first round, the others from the second, each taking a finished row's place. Returns the engine."""
    target, draft, bundle = quantized
    config = SpecConfig(batch_size=3, prefill_chunk=chunk, eos_token_ids=(bundle.eos_id,), pad_token_id=bundle.pad_id,
                        check_invariants=True, **settings)
    engine = engine_for(target, draft, config)
    with torch.inference_mode():
        drive(engine, make_scheduler(config, online=True), Arrivals(rows, later=1))
    return engine


@pytest.mark.parametrize(
    "method, proposer, k",
    [("autoregressive", None, 1), ("eqspec", "hybrid", "auto"), ("exspec", "draft", 2), ("eqspec", "ngram", 3)],
)
def test_prompts_read_inside_the_rounds_give_the_quantized_models_own_tokens(method, proposer, k, quantized):
    """Seven prompts of budgets 6 to 24: each row that joins while others decode reads its prompt inside their rounds,
    4 columns a round, and every answer is the quantized target's own. With no chunk set (offline) prompts are read
    apart, whole, as before."""
    target, _, bundle = quantized
    prompts = [prompt for prompt, _ in bundle.probe[:7]]
    budgets = [6 + 3 * i for i in range(7)]
    expected = [reference_greedy(target, p, n, bundle.eos_id) for p, n in zip(prompts, budgets, strict=True)]
    for chunk in (CHUNK, None):
        rows = [Sequence(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
        engine = _served(quantized, rows, chunk, method=method, proposer=proposer, num_draft_tokens=k)
        assert [row.output for row in rows] == expected
        assert (engine.stats.riding_columns > 0) == (chunk is not None) and engine.stats.recomputed_columns == 0


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_a_row_that_joins_streams_rides_and_reads_the_rest_at_once_when_nothing_decodes(method, quantized,
                                                                                       monkeypatch):
    """Row 0 (a budget of 3) decodes from the first round; rows 1 and 2 (prompts of 40 tokens) join in the second and
    ride in its rounds, at most 4 columns each a round; once row 0 is done, they read what is left of their prompts in
    one round. No prompt chunk is read apart, and every answer is the target's greedy one."""
    target, _, bundle = quantized
    prompts = [prompt for prompt, _ in bundle.probe[:3]]
    budgets = (3, 16, 16)
    rides: list[list[int]] = []
    ride = Engine.ride

    def recorded(self, rows):
        done = ride(self, rows)
        rides.append(done.columns)
        return done

    monkeypatch.setattr(Engine, "ride", recorded)
    rows = [Sequence(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    engine = _served(quantized, rows, method=method, proposer="hybrid", num_draft_tokens="auto")
    expected = [reference_greedy(target, p, n, bundle.eos_id) for p, n in zip(prompts, budgets, strict=True)]
    assert [row.output for row in rows] == expected
    ridden = [columns for columns in rides if any(columns)]
    assert len(ridden) >= 2 and all(max(columns) <= CHUNK for columns in ridden[:-1]), ridden
    assert max(ridden[-1]) > CHUNK and len(ridden[-1]) == 2, ridden  # the rest, at once, without row 0
    assert engine.stats.riding_columns == sum(len(p) - 1 for p in prompts[1:])
    assert engine.stats.prefill_chunks == 1, engine.stats.to_dict()  # row 0's prompt only


def test_seeded_samples_do_not_depend_on_who_rides_beside_them(quantized, bs):
    """Seeded sampling rows decoded alone, and three at a time with each newcomer's prompt read inside the others'
    rounds, draw the same tokens (a riding row draws nothing: its random numbers stay its own for its outputs)."""
    target, draft, bundle = quantized
    prompts = [prompt + prompt[:4] + prompt for prompt, _ in bundle.probe[:6]]
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    alone = bs.generate(target, draft, prompts, method="eqspec", proposer="hybrid", batch_size=1, num_draft_tokens=3,
                        max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7, eos_token_id=bundle.eos_id,
                        pad_token_id=bundle.pad_id)
    seeds = derive_row_seeds(7, len(prompts))
    rows = [Sequence(i, p, 12, sampling=sampling, row_seed=seed) for i, (p, seed) in enumerate(zip(prompts, seeds,
                                                                                                 strict=True))]
    engine = _served(quantized, rows, method="eqspec", proposer="hybrid", num_draft_tokens="auto")
    assert engine.stats.riding_columns > 0
    assert [row.output for row in rows] == alone.sequences
