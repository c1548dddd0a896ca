"""Proposers beyond the draft model: prompt lookup (ngram), hybrid, per-row lengths and the adaptive length.

* The n-gram index against a brute-force lookup (hypothesis), and its incremental updates; the device lookup
  (rows of a left-padded token matrix at once) against the same brute force.
* Greedy equivalence with transformers' own ``generate`` for ngram, hybrid and ``num_draft_tokens="auto"``, with
  prompts that repeat segments (lookups fire) and prompts that do not, pad and EOS ids inside prompts, EqSpec and
  ExSpec.
* Per-row lengths: rows that propose nothing, and rows whose own budget caps their length, in one round.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from helpers import engine_for
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.config import SpecConfig
from batchspec.engine.lookup import NgramIndex, lookup_on_device
from batchspec.engine.proposers.draft import PAST_MODEL_NGRAM, _RoundDrafts
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.schedulers import make_scheduler
from batchspec.engine.schedulers.drive import Offline, drive
from batchspec.engine.state import Sequence
from batchspec.engine.verifier import verify_greedy


def brute_force_lookup(text: list[int], n_min: int, n_max: int) -> int | None:
    """The token after the earliest occurrence of the longest suffix n-gram that occurred before, by scanning."""
    for n in range(min(n_max, len(text) - 1), n_min - 1, -1):
        suffix = text[len(text) - n :]
        for end in range(n - 1, len(text) - 1):
            if text[end - n + 1 : end + 1] == suffix:
                return text[end + 1]
    return None


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    text=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    split=st.integers(0, 40),
    n_range=st.sampled_from([(1, 3), (2, 4), (1, 1), (3, 3)]),
    limits=st.lists(st.integers(0, 8), min_size=1, max_size=3),
)
def test_chain_matches_a_brute_force_lookup(text, split, n_range, limits):
    """Asked again of the same text (a round's reach, then its plan), for fewer or more drafts: still the lookup's."""
    n_min, n_max = n_range
    index = NgramIndex(n_min, n_max)
    index.extend(text[:split])  # indexed in two steps, as a row's text grows
    index.chain(4)  # a chain of the shorter text, which the longer one must not reuse
    index.extend(text[split:])
    for limit in limits:
        expected, context = [], list(text)
        while len(expected) < limit and (token := brute_force_lookup(context, n_min, n_max)) is not None:
            expected.append(token)
            context.append(token)
        assert index.chain(limit) == expected
    assert index.tokens == text, "a chain must not change the index"


def brute_force_ends(text: list[int], n_min: int, n_max: int) -> dict[tuple[int, ...], int]:
    """Every n-gram of ``text`` with a next token, and the last index of its earliest occurrence, by scanning."""
    ends: dict[tuple[int, ...], int] = {}
    for end in range(len(text) - 1):
        for n in range(n_min, min(n_max, end + 1) + 1):
            ends.setdefault(tuple(text[end - n + 1 : end + 1]), end)
    return ends


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    text=st.lists(st.integers(0, 5), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=5),
    n_range=st.sampled_from([(1, 3), (2, 4), (1, 1), (3, 3), (2, 6)]),
)
def test_an_index_extended_piece_by_piece_is_the_one_built_at_once(text, cuts, n_range):
    """Extended by the tokens a row gained each round (pieces of any length, empty ones too), the index holds what
    one built from the whole text holds, and what a scan finds; so do their chains."""
    n_min, n_max = n_range
    pieces, whole = NgramIndex(n_min, n_max), NgramIndex(n_min, n_max)
    bounds = [0, *sorted(min(cut, len(text)) for cut in cuts), len(text)]
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        pieces.extend(text[start:stop])
    whole.extend(text)
    assert pieces.tokens == whole.tokens == text
    assert pieces.ends == whole.ends == brute_force_ends(text, n_min, n_max)
    assert pieces.chain(6) == whole.chain(6)


def test_the_docstring_example():
    index = NgramIndex(1, 3)
    index.extend(list("abcdxabc"))
    assert index.chain(4) == list("dxab")
    earliest = NgramIndex(1, 3)
    earliest.extend(list("abxabyab"))
    assert earliest.chain(1) == ["x"]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    texts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
    filler=st.integers(0, 4),
    n_range=st.sampled_from([(1, 3), (2, 4), (1, 1), (3, 5)]),
)
def test_device_lookup_matches_a_brute_force_lookup(texts, filler, n_range):
    """Every row of a left-padded matrix (its padding holds a token its text may contain: never matched) gets the
    brute-force lookup of its own text; the device lookup needs at least two columns, as after a drafted token."""
    n_min, n_max = n_range
    width = max(2, max(len(text) for text in texts))
    pad = [width - len(text) for text in texts]
    matrix = torch.tensor([[filler] * p + text for p, text in zip(pad, texts, strict=True)])
    draft, found = lookup_on_device(matrix, torch.tensor(pad), n_min, n_max)
    for i, text in enumerate(texts):
        expected = brute_force_lookup(text, n_min, n_max)
        assert bool(found[i]) == (expected is not None), (text, pad[i])
        if expected is not None:
            assert int(draft[i]) == expected, (text, pad[i])


def test_device_lookup_docstring_example():
    text = torch.tensor([[7, 0, 1, 2, 0, 1, 3, 0, 1]])  # a padding column, then a b x a b y a b
    draft, found = lookup_on_device(text, torch.tensor([1]), 1, 3)
    assert found.tolist() == [True] and draft.tolist() == [2]


# ---- greedy equivalence ---------------------------------------------------------------------------------


def repeating_prompts(bundle, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat segments of themselves (lookups find matches), with pad and EOS ids inside."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        segment = [rng.randrange(tiny_models.VOCAB_SIZE) for _ in range(rng.randint(2, 9))]
        prompt = segment * rng.randint(2, 4) + [rng.randrange(tiny_models.VOCAB_SIZE) for _ in range(i % 5)]
        prompt[rng.randrange(len(prompt))] = bundle.pad_id if i % 2 else bundle.eos_id
        prompts.append(prompt)
    return prompts


CASES = [
    # (proposer, draft kind, num_draft_tokens, method, batch size)
    ("ngram", None, 4, "eqspec", 4),
    ("ngram", None, "auto", "exspec", 3),
    ("ngram", None, 1, "exspec", 2),
    ("hybrid", "perturbed", 3, "eqspec", 3),
    ("hybrid", "unrelated", "auto", "exspec", 4),
    ("hybrid", "identical", 5, "eqspec", 4),
    ("draft", "perturbed", "auto", "eqspec", 4),
    ("draft", "identical", "auto", "exspec", 3),
]


@pytest.mark.parametrize("repeating", [True, False], ids=["repeating", "random"])
@pytest.mark.parametrize(("proposer", "draft", "k", "method", "batch_size"), CASES)
@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_matches_reference(target, proposer, draft, k, method, batch_size, repeating, bs, bundles, make_prompts,
                           reference, check):
    bundle = bundles[target]
    prompts = repeating_prompts(bundle, 7, seed=5) if repeating else make_prompts(bundle, 7, seed=6)
    result = bs.generate(
        bundle.target, None if draft is None else bundle.drafts[draft], prompts, method=method, proposer=proposer,
        batch_size=batch_size, window_size=batch_size + 2 if method == "exspec" else None, max_new_tokens=21,
        num_draft_tokens=k, check_invariants=True,
    )
    refs = [reference(bundle.target, p, 21, bundle.eos_id) for p in prompts]
    check.result_matches(result, prompts, refs, 21, bundle.eos_id)
    assert result.stats.recomputed_columns == 0
    if repeating and proposer != "draft" and k != "auto":  # auto proposes only where the host's timings make it pay
        assert result.stats.draft_tokens_proposed > 0, "lookups found nothing in repeating prompts"


@pytest.mark.parametrize(("text", "sampled", "found"), [
    ([1, 2, 3, 4, 7, 8, 2, 3], False, 7), ([1, 2, 3, 4, 7, 8, 9, 3], False, None), ([1, 2, 3, 4, 7, 8, 9, 3], True, 7),
], ids=["three-token suffix", "two-token suffix", "two-token suffix, sampling row"])
def test_a_lookup_past_a_draft_models_draft_must_copy(text, sampled, found):
    """The model drafted 4 after the row's text, past its (empty) lookup chain: the next position is looked up over
    the text and that draft. Where ``2 3 4`` occurred before (followed by 7) the lookup takes the position; where
    only ``3 4`` did, a suffix shorter than :data:`PAST_MODEL_NGRAM` (3), it leaves the position to the model in a
    greedy row; a sampling row's draft follows the lookup's own minimum (1) wherever its round began."""
    assert PAST_MODEL_NGRAM == 3
    k = 2
    batch = SimpleNamespace(tokens=torch.tensor([text]), size=1, pad=torch.tensor([0]))  # [1, L]
    staged = (torch.tensor([k]), torch.zeros((1, k + 1), dtype=torch.long), torch.tensor([0]))  # [1], [1, k+1], [1]
    plan = SimpleNamespace(staged=staged, host=SimpleNamespace(lengths=[k]), lookups=[0])
    drafts = _RoundDrafts(batch, plan, NgramProposer(1, 5), torch.tensor([True]) if sampled else None)
    needed = [[True] * k + [False]]
    assert not drafts.past_chains(0, needed) and drafts.past_chains(1, needed)
    drafts.fill(0, torch.tensor([4]))
    drafts.look_up(1, read=True)
    assert drafts.looked_up[0].tolist() == [False, found is not None, False]
    assert drafts.chained(1, needed) == (found is not None)
    if found is not None:
        assert drafts.tokens[0, 1].item() == found


# ---- per-row lengths ------------------------------------------------------------------------------------


def test_greedy_verification_caps_each_row_at_its_length():
    target_logits = torch.zeros(4, 4, 6)  # [B, k+1, V]
    target_logits[:, :, 2] = 1.0  # the target's argmax is 2 everywhere
    drafts = torch.full((4, 3), 2)  # [B, k]: every draft agrees
    verdict = verify_greedy(drafts, target_logits, torch.tensor([3, 2, 0, 1]))
    assert verdict.accepted.tolist() == [3, 2, 0, 1]
    drafts[0, 1] = 5
    assert verify_greedy(drafts, target_logits, torch.tensor([3, 2, 0, 1])).accepted.tolist() == [1, 2, 0, 1]


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_each_row_is_capped_by_its_own_budget(proposer, llama, reference):
    """Rows with budgets of 1, 2, 3 and 30 tokens decode together; each drafts within its own budget only."""
    config = SpecConfig(batch_size=4, num_draft_tokens=6, proposer=proposer, check_invariants=True)
    engine = engine_for(llama.target, llama.drafts["identical"] if proposer == "draft" else None, config)
    prompts = repeating_prompts(llama, 4, seed=3)
    rows = [Sequence(i, p, budget) for i, (p, budget) in enumerate(zip(prompts, [1, 2, 3, 30], strict=True))]
    scheduler = make_scheduler(engine.config)
    for row in rows:
        scheduler.add(row)
    with torch.inference_mode():
        drive(engine, scheduler, Offline(lambda done: None))
    for row in rows:
        assert row.output == reference(llama.target, row.prompt, row.max_new_tokens, llama.eos_id)
    if proposer == "draft":  # the identical draft is always right: the long row gains k + 1 per round
        assert engine.stats.draft_tokens_accepted == engine.stats.draft_tokens_proposed
        assert max(engine.stats.accepted_length_histogram) == 6
