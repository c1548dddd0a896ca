"""Lossless sampling end to end: ``batchspec.generate`` with temperature > 0.

* Distribution: the first two tokens of one prompt, generated thousands of times with different seeds, follow
  the target's own joint distribution ``P(t1) P(t2 | t1)`` (chi-square), for every method and for warped
  (temperature, top-k, top-p) distributions; deliberately wrong verifiers fail the same test.
* Determinism: a row's tokens depend only on its prompt, its seed, the sampling settings and the models, not on
  batch size, method, window, ``num_draft_tokens`` or the order of the prompts.
* Collapse: top-k 1 and a tiny top-p give the target's greedy output token for token.

The models are tiny random float64 LMs with small vocabularies, so that a few thousand samples cover every
pair of tokens. Every run checks the batch invariants after every round.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
import tiny_models
import torch
from helpers import engine_for, exact_joint, joint_pvalue, reference_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchspec
import batchspec.engine.core as engine
import batchspec.engine.draft_length as draft_length
import batchspec.engine.verifier as verifier
from batchspec.config import SamplingParams, SpecConfig
from batchspec.engine.prefill import Reader, catch_up
from batchspec.engine.realign import plan_layout
from batchspec.engine.sampling import derive_row_seeds
from batchspec.engine.schedulers import make_scheduler
from batchspec.engine.schedulers.drive import Offline, drive
from batchspec.engine.state import Sequence

PASS_P = 1e-3
FAIL_P = 1e-6

STAT_VOCAB = 10
STAT_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
LOOKUP_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1)  # ends in 1, seen before: the lookup drafts 5, 9, 2, ...
STAT_ROWS = 4000
STAT_BATCH = 256

SEQ_VOCAB = 32
SEQ_EOS = [0, 1]
SEQ_MAX_NEW = 16
SEQ_SAMPLING = {"temperature": 0.8, "top_k": 16, "top_p": 0.95}


@dataclass(frozen=True)
class Models:
    target: torch.nn.Module
    perturbed: torch.nn.Module  # partial acceptance
    identical: torch.nn.Module  # q = p: every draft is accepted


def build_models(builder, vocab: int, seed: int) -> Models:
    target = builder(seed=seed, vocab_size=vocab, initializer_range=0.2, hidden_size=32, intermediate_size=64)
    return Models(
        target=target,
        perturbed=tiny_models.perturbed_copy(target, 0.2, seed=seed + 1),
        identical=copy.deepcopy(target),
    )


@pytest.fixture(scope="module")
def stat_models() -> Models:
    """Llama with a 10-token vocabulary: 100 pairs of tokens; the perturbed draft accepts about 55%."""
    return build_models(tiny_models.build_llama, STAT_VOCAB, seed=11)


@pytest.fixture(scope="module")
def seq_models() -> Models:
    """Qwen2 with a 32-token vocabulary, for longer sequences that end at EOS or at the budget."""
    return build_models(tiny_models.build_qwen2, SEQ_VOCAB, seed=21)


# ---- the joint distribution of the first two tokens --------------------------------------------------------


@dataclass(frozen=True)
class StatCase:
    """One chi-square run. With ``max_new_tokens=2`` the draft length is clipped to 1, so the second token is
    decided at the bonus position (with ``d_{k+1}``); with 3 it is a drafted position of a ``k = 2`` round."""

    method: str
    sampling: dict
    seed: int
    max_new_tokens: int = 2
    proposer: str = "draft"
    num_draft_tokens: int | str = 3
    prompt: tuple[int, ...] = tuple(STAT_PROMPT)


STAT_CASES = {
    "eqspec": StatCase("eqspec", {"temperature": 1.0}, seed=1001),
    "exspec": StatCase("exspec", {"temperature": 1.0}, seed=1002),
    "eqspec-k2": StatCase("eqspec", {"temperature": 1.0}, seed=1007, max_new_tokens=3),
    "autoregressive": StatCase("autoregressive", {"temperature": 1.0}, seed=1003),
    "eqspec-cold-top_k": StatCase("eqspec", {"temperature": 0.7, "top_k": 5}, seed=1004),
    "exspec-hot-top_p": StatCase("exspec", {"temperature": 1.5, "top_p": 0.8}, seed=1005, max_new_tokens=3),
    "eqspec-top_k-top_p": StatCase("eqspec", {"temperature": 1.0, "top_k": 6, "top_p": 0.9}, seed=1006),
    "eqspec-auto": StatCase("eqspec", {"temperature": 1.0}, seed=1008, max_new_tokens=3, num_draft_tokens="auto"),
    "ngram": StatCase("eqspec", {"temperature": 1.0}, seed=1009, proposer="ngram", prompt=LOOKUP_PROMPT),
    "ngram-k2-top_p": StatCase("exspec", {"temperature": 1.2, "top_p": 0.9}, seed=1010, max_new_tokens=3,
                               proposer="ngram", prompt=LOOKUP_PROMPT),
    "hybrid": StatCase("eqspec", {"temperature": 1.0}, seed=1011, max_new_tokens=3, proposer="hybrid",
                       prompt=LOOKUP_PROMPT),
    "hybrid-auto-top_k": StatCase("exspec", {"temperature": 0.8, "top_k": 7}, seed=1012, proposer="hybrid",
                                  num_draft_tokens="auto", prompt=LOOKUP_PROMPT),
}


def sample_pairs(models: Models, case: StatCase) -> batchspec.GenerationResult:
    """``STAT_PROMPT`` generated for ``STAT_ROWS`` seeds derived from ``case.seed``."""
    result = batchspec.generate(
        models.target,
        None if case.proposer == "ngram" else models.perturbed,
        [list(case.prompt)] * STAT_ROWS,
        method=case.method,
        proposer=None if case.method == "autoregressive" else case.proposer,
        batch_size=STAT_BATCH,
        max_new_tokens=case.max_new_tokens,
        num_draft_tokens=case.num_draft_tokens,
        eos_token_id=[],
        seed=case.seed,
        check_invariants=True,
        **case.sampling,
    )
    assert all(len(s) == case.max_new_tokens for s in result.sequences)
    return result


def stat_run(models: Models, case: StatCase) -> tuple[float, float]:
    """(chi-square p-value of the first two tokens, acceptance rate) of one case."""
    joint = exact_joint(models.target, list(case.prompt), SamplingParams(**case.sampling))
    result = sample_pairs(models, case)
    return joint_pvalue([s[:2] for s in result.sequences], joint), result.stats.acceptance_rate


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_first_two_tokens_follow_the_target(case, stat_models, monkeypatch):
    """The first two tokens follow the target's joint distribution. Drafts are accepted partially, except where
    the planner may rightly decline to draft: with ``"auto"`` a draft model as large as the target never pays. A
    lookup is priced at 0.9 before any was tested, so that ``"auto"`` proposes (and this tests) lookups on any host's
    costs."""
    monkeypatch.setitem(draft_length.FIRST_PRIOR, "lookup", 0.9)
    pvalue, acceptance = stat_run(stat_models, STAT_CASES[case])
    assert pvalue > PASS_P, (case, pvalue)
    declines = STAT_CASES[case].num_draft_tokens == "auto" and STAT_CASES[case].proposer == "draft"
    if STAT_CASES[case].method != "autoregressive" and not declines:
        assert 0.05 < acceptance < 0.95, f"drafts should be accepted partially: {acceptance}"


def test_float32_models_keep_q_in_float32_and_stay_lossless(stat_models, monkeypatch):
    target = copy.deepcopy(stat_models.target).float()
    models = Models(target=target, perturbed=copy.deepcopy(stat_models.perturbed).float(), identical=target)
    q_dtypes = set()

    def recording(draft_tokens, q, p, rand, *args):
        q_dtypes.add(q.dtype)
        return verifier.verify_sampling(draft_tokens, q, p, rand, *args)

    monkeypatch.setattr(engine, "verify_sampling", recording)
    pvalue, _ = stat_run(models, STAT_CASES["eqspec"])
    assert q_dtypes == {torch.float32}
    assert pvalue > PASS_P, pvalue


WRONG = {
    "recovered_from_p": ("_residual", lambda p, q: p),
    "drafts_always_accepted": ("_accept", lambda u, p, q: torch.ones_like(u, dtype=torch.bool)),
}


@pytest.mark.parametrize("variant", list(WRONG))
def test_a_wrong_verifier_fails_end_to_end(variant, stat_models, monkeypatch):
    helper, wrong = WRONG[variant]
    monkeypatch.setattr(verifier, helper, wrong)
    pvalue, _ = stat_run(stat_models, STAT_CASES["eqspec"])
    assert pvalue < FAIL_P, (variant, pvalue)


# ---- a row's tokens do not depend on how it is batched ---------------------------------------------------


def seq_prompts(n: int = 8, seed: int = 5) -> list[list[int]]:
    """Prompts of lengths 1 .. 30 over the whole vocabulary (EOS ids included)."""
    rng = random.Random(seed)
    lengths = [1, 30] + [rng.randint(1, 30) for _ in range(n - 2)]
    return [[rng.randrange(SEQ_VOCAB) for _ in range(length)] for length in lengths]


def run_seq(models: Models, prompts, *, draft: str = "perturbed", **kw) -> batchspec.GenerationResult:
    kw = {"max_new_tokens": SEQ_MAX_NEW, "eos_token_id": SEQ_EOS, "check_invariants": True, "proposer": "draft", **kw}
    model = None if kw.get("proposer") == "ngram" else getattr(models, draft)
    return batchspec.generate(models.target, model, prompts, **kw)


@pytest.fixture(scope="module")
def seq_reference(seq_models) -> batchspec.GenerationResult:
    """Every prompt decoded alone (batch size 1), EqSpec with 3 drafts per round."""
    result = run_seq(
        seq_models, seq_prompts(), method="eqspec", batch_size=1, num_draft_tokens=3, seed=7, **SEQ_SAMPLING
    )
    reasons = set(result.finish_reasons)
    assert reasons == {"eos", "length"}, f"want rows that end at EOS and rows that run out: {reasons}"
    return result


BATCHINGS = {
    "eqspec-b3": {"method": "eqspec", "batch_size": 3},
    "eqspec-b8": {"method": "eqspec", "batch_size": 8},
    "eqspec-b3-k1": {"method": "eqspec", "batch_size": 3, "num_draft_tokens": 1},
    "eqspec-b8-k6": {"method": "eqspec", "batch_size": 8, "num_draft_tokens": 6},
    "eqspec-b8-auto": {"method": "eqspec", "batch_size": 8, "num_draft_tokens": "auto"},
    "exspec-b1-w3": {"method": "exspec", "batch_size": 1, "window_size": 3},
    "exspec-b3-w3": {"method": "exspec", "batch_size": 3, "window_size": 3},
    "exspec-b3-w7-k2": {"method": "exspec", "batch_size": 3, "window_size": 7, "num_draft_tokens": 2},
    "exspec-b8-k5": {"method": "exspec", "batch_size": 8},
    "exspec-b2-unsorted": {"method": "exspec", "batch_size": 2, "window_size": 5, "sort_by_length": False},
}


@pytest.mark.parametrize("batching", list(BATCHINGS))
def test_tokens_do_not_depend_on_batching(batching, seq_models, seq_reference):
    kw = {"num_draft_tokens": 3, **BATCHINGS[batching]}
    result = run_seq(seq_models, seq_prompts(), seed=7, **SEQ_SAMPLING, **kw)
    assert result.sequences == seq_reference.sequences
    assert result.finish_reasons == seq_reference.finish_reasons


LOOKUP_BATCHINGS = {
    "eqspec-b8-auto": {"method": "eqspec", "batch_size": 8, "num_draft_tokens": "auto"},
    "eqspec-b3-k1": {"method": "eqspec", "batch_size": 3, "num_draft_tokens": 1},
    "exspec-b3-w5-k5": {"method": "exspec", "batch_size": 3, "window_size": 5, "num_draft_tokens": 5},
}


@pytest.mark.parametrize("batching", list(LOOKUP_BATCHINGS))
@pytest.mark.parametrize("proposer", ["ngram", "hybrid"])
def test_lookup_tokens_do_not_depend_on_batching(proposer, batching, seq_models):
    """A lookup draft is a function of the text before it, so lookups keep the seed guarantee too."""
    prompts = [p + p[:6] + p for p in seq_prompts()]  # repeated segments: lookups find matches
    alone = run_seq(seq_models, prompts, method="eqspec", batch_size=1, num_draft_tokens=3, proposer=proposer,
                    seed=7, **SEQ_SAMPLING)
    assert alone.stats.draft_tokens_proposed > 0
    result = run_seq(seq_models, prompts, seed=7, proposer=proposer, **SEQ_SAMPLING, **LOOKUP_BATCHINGS[batching])
    assert result.sequences == alone.sequences
    other = run_seq(seq_models, prompts, seed=8, proposer=proposer, **SEQ_SAMPLING, **LOOKUP_BATCHINGS[batching])
    assert other.sequences != alone.sequences


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_shuffled_prompts_with_their_seeds_keep_their_tokens(method, seq_models, seq_reference):
    prompts = seq_prompts()
    seeds = derive_row_seeds(7, len(prompts))
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    shuffled = run_seq(
        seq_models,
        [prompts[i] for i in order],
        method=method,
        batch_size=3,
        seed=[seeds[i] for i in order],
        **SEQ_SAMPLING,
    )
    assert shuffled.sequences == [seq_reference.sequences[i] for i in order]


def test_other_seeds_give_other_tokens(seq_models, seq_reference):
    other = run_seq(seq_models, seq_prompts(), method="eqspec", batch_size=8, seed=8, **SEQ_SAMPLING)
    differ = sum(a != b for a, b in zip(other.sequences, seq_reference.sequences, strict=True))
    assert differ >= len(seq_reference.sequences) - 1
    listed = run_seq(
        seq_models, seq_prompts(), method="eqspec", batch_size=8, seed=derive_row_seeds(7, 8), **SEQ_SAMPLING
    )
    assert listed.sequences == seq_reference.sequences, "an int seed stands for the seeds derived from it"


def test_a_draft_equal_to_the_target_gives_plain_sampling(seq_models):
    """With q = p every draft is accepted, so speculative sampling realises the same tokens as the target alone;
    another draft gives other (equally distributed) tokens for the same seeds."""
    prompts = seq_prompts()
    plain = run_seq(seq_models, prompts, method="autoregressive", batch_size=3, seed=9, **SEQ_SAMPLING)
    same = run_seq(seq_models, prompts, draft="identical", method="eqspec", batch_size=3, seed=9, **SEQ_SAMPLING)
    assert same.sequences == plain.sequences
    assert same.stats.acceptance_rate == 1.0
    other = run_seq(seq_models, prompts, method="eqspec", batch_size=3, seed=9, **SEQ_SAMPLING)
    assert other.sequences != plain.sequences


# ---- collapse to greedy decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eqspec", "exspec", "autoregressive"])
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.7, "top_k": 1}, {"temperature": 1.3, "top_p": 1e-9}, {"temperature": 0.0},
     {"temperature": 5e-324}],
    ids=["top_k_1", "tiny_top_p", "temperature_0", "subnormal_temperature"],
)
def test_degenerate_sampling_is_greedy(method, sampling, seq_models):
    prompts = seq_prompts()
    result = run_seq(seq_models, prompts, method=method, batch_size=3, seed=11, **sampling)
    expected = [reference_greedy(seq_models.target, p, SEQ_MAX_NEW, SEQ_EOS) for p in prompts]
    assert result.sequences == expected


# ---- arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "seed": -1}, "seed"),
        ({"temperature": 1.0, "seed": 2**63}, "seed"),
        ({"temperature": 1.0, "seed": [1, 2]}, "seed"),
        ({"temperature": 1.0, "seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_arguments_are_rejected(kwargs, name, seq_models):
    with pytest.raises(ValueError, match=name):
        run_seq(seq_models, seq_prompts(3), method="eqspec", **kwargs)


def test_rows_with_different_settings_share_rounds(seq_models):
    """Greedy rows and rows with different temperatures, top-k and top-p decode in the same rounds, and each gets
    the tokens it gets alone."""
    prompts = seq_prompts()
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=16, top_p=0.95),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.5, top_p=0.7),
    ] * 2
    seeds = derive_row_seeds(7, len(prompts))
    config = SpecConfig(
        batch_size=8, num_draft_tokens=3, eos_token_ids=tuple(SEQ_EOS), check_invariants=True, proposer="draft"
    )
    decoder = engine_for(seq_models.target, seq_models.perturbed, config)
    rows = [
        Sequence(i, p, SEQ_MAX_NEW, sampling=s, row_seed=seed)
        for i, (p, s, seed) in enumerate(zip(prompts, settings, seeds, strict=True))
    ]
    scheduler = make_scheduler(decoder.config)
    for row in rows:
        scheduler.add(row)
    with torch.inference_mode():
        drive(decoder, scheduler, Offline(lambda done: None))
    assert decoder.stats.rows_per_round_histogram.get(8, 0) > 0, "the rows never shared a round"
    for row in rows:
        params = row.sampling
        alone = run_seq(
            seq_models, [row.prompt], method="eqspec", batch_size=1, num_draft_tokens=3, seed=[row.row_seed],
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        )
        assert row.output == alone.sequences[0], params


# ---- any schedule: planner choices, arrivals, chunked prefill --------------------------------------------


class Arrivals(Offline):
    """Driver hooks that queue rows a few at a time, as a server's requests arrive between rounds."""

    def __init__(self, rows: list[Sequence], batches: list[int]) -> None:
        super().__init__(lambda finished: None)
        self.pending, self.batches = list(rows), list(batches)

    def admit(self, scheduler) -> bool:
        for _ in range(self.batches.pop(0) if self.batches else len(self.pending)):
            if self.pending:
                scheduler.add(self.pending.pop(0))
        return bool(self.pending) or super().admit(scheduler)


class DrawnLengths:
    """Stands in for the adaptive planner: every round's lengths are drawn (within what each row can propose), and
    whether the draft reads new prompts, so the test covers choices a planner could make under any timing,
    including "lookups alone" rounds and rows joining while the draft is idle."""

    def __init__(self, planner, draw) -> None:
        self.planner, self.draw = planner, draw
        self.observe = planner.observe
        planner.observe = self.observed

    def observed(self, rows, record) -> None:
        """The planner learns from the round, and whether new prompts are read by the draft too is drawn: rows
        then join with a draft that holds none, part or all of their prompt."""
        self.observe(rows, record)
        self.planner.drafting = self.draw(st.booleans())

    def __call__(self, rows, reach, sampled: bool, *, draining: bool = False, cap: float | None = None) -> list[int]:
        limits = [min(self.planner.max_k, row.remaining - 1) for row in rows]
        k = self.draw(st.integers(0, max(limits, default=0)))
        if reach.uses_draft_model and any(reach.lookups) and self.draw(st.booleans()):
            return [min(k, limit, looked) for limit, looked in zip(limits, reach.lookups, strict=True)]
        return [reach.available(i, min(k, limit)) for i, limit in enumerate(limits)]


SCHEDULE_PROMPTS = [p + p[:6] + p if i % 3 else p for i, p in enumerate(seq_prompts(6, seed=9))]


@pytest.fixture(scope="module")
def schedule_references(seq_models) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per proposer: each prompt decoded alone, seeded-sampled and greedy."""
    refs = {}
    for proposer in ("draft", "ngram", "hybrid"):
        kw = {"method": "eqspec", "batch_size": 1, "num_draft_tokens": 3, "proposer": proposer}
        sampled = run_seq(seq_models, SCHEDULE_PROMPTS, seed=7, **SEQ_SAMPLING, **kw).sequences
        refs[proposer] = (sampled, run_seq(seq_models, SCHEDULE_PROMPTS, **kw).sequences)
    return refs


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    proposer=st.sampled_from(["draft", "ngram", "hybrid"]),
    method=st.sampled_from(["eqspec", "exspec"]),
    online=st.booleans(),
    batch_size=st.integers(1, 4),
    chunk=st.sampled_from([None, 3, 8]),
    greedy=st.sets(st.integers(0, len(SCHEDULE_PROMPTS) - 1), max_size=3),
    arrivals=st.lists(st.integers(0, 3), max_size=12),
    data=st.data(),
)
def test_seeded_tokens_do_not_depend_on_the_schedule(
    proposer, method, online, batch_size, chunk, greedy, arrivals, data, seq_models, schedule_references
):
    """Whatever lengths each round takes, however rows arrive and share rounds with greedy rows, however their
    prompts are chunked, and with the offline or the server's scheduler, every seeded row gets the tokens it gets alone
    (and every greedy row its greedy tokens)."""
    config = SpecConfig(
        method=method, batch_size=batch_size, num_draft_tokens="auto", proposer=proposer, prefill_chunk=chunk,
        eos_token_ids=tuple(SEQ_EOS), check_invariants=True,
    )
    decoder = engine_for(seq_models.target, None if proposer == "ngram" else seq_models.perturbed, config)
    decoder.planner.lengths = DrawnLengths(decoder.planner, data.draw)
    seeds = derive_row_seeds(7, len(SCHEDULE_PROMPTS))
    rows = [
        Sequence(i, p, SEQ_MAX_NEW, sampling=SamplingParams() if i in greedy else SamplingParams(**SEQ_SAMPLING),
                 row_seed=seed)
        for i, (p, seed) in enumerate(zip(SCHEDULE_PROMPTS, seeds, strict=True))
    ]
    with torch.inference_mode():
        drive(decoder, make_scheduler(decoder.config, online=online), Arrivals(rows, arrivals))
    sampled, plain = schedule_references[proposer]
    assert [row.output for row in rows] == [plain[i] if i in greedy else sampled[i] for i in range(len(rows))]


def test_rows_a_draft_catch_up_leaves_behind_are_caught_up_too(seq_models):
    """The state a load test reached: row 0 decodes with its draft up to date, row 1 joined while the draft read
    only 10 of its 29 prompt columns, row 2 (a short prompt) while it read none. Catching up row 1 alone makes the
    batch keep all 29 draft columns, past where row 2 starts, so row 2's draft would attend to columns it never
    read and draw from a wrong q: seeded rows then changed their tokens. Each row gets the tokens it gets alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, SEQ_VOCAB) for _ in range(n)] for n in (30, 30, 8)]
    seeds = derive_row_seeds(7, len(prompts))
    alone = [
        run_seq(seq_models, [p], batch_size=1, seed=[s], **SEQ_SAMPLING).sequences[0]
        for p, s in zip(prompts, seeds, strict=True)
    ]
    config = SpecConfig(
        batch_size=3, num_draft_tokens=2, eos_token_ids=tuple(SEQ_EOS), proposer="draft", check_invariants=True,
    )
    decoder = engine_for(seq_models.target, seq_models.perturbed, config)
    rows = [
        Sequence(i, p, SEQ_MAX_NEW, sampling=SamplingParams(**SEQ_SAMPLING), row_seed=s)
        for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
    ]
    target, draft = Reader(seq_models.target), Reader(seq_models.perturbed, is_draft=True)
    read = dict(filler=0, layers=decoder.layers)
    with torch.inference_mode():
        first = catch_up(rows[:1], [target, draft], decoder.runner, limit=None, **read)
        catch_up(rows[1:], [target], decoder.runner, limit=None, **read)
        partial = catch_up(rows[1:2], [draft], decoder.runner, limit=10, **read)
        assert [row.kv.draft_cached for row in rows] == [29, 10, 0]
        assert first.tokens == {False: 29, True: 29} and partial.tokens == {True: 10}  # what the planner prices
        assert plan_layout(rows).lagging == (1,)  # row 2 lags only once row 1 caught up
        while unfinished := [row for row in rows if not row.finished]:
            decoder.step(unfinished)
    assert [row.output for row in rows] == alone
