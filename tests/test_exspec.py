"""ExSpec: the same exact-equivalence contract as EqSpec, plus the pool and its grouping behaviour.

Every run uses ``check_invariants=True``, which also checks the sequence pool after every round.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pytest
import tiny_models
from helpers import forward_log, make_prompts_for

from batchspec.config import SpecConfig
from batchspec.engine.errors import InvariantError
from batchspec.engine.schedulers.pool import PooledWindow
from batchspec.engine.state import Sequence

X = "exspec"


class Case(NamedTuple):
    target: str
    draft: str
    n_prompts: int
    batch_size: int
    window: int | None
    k: int
    max_new: int


CASES = [
    Case("llama", "identical", 3, 1, None, 1, 13),
    Case("llama", "identical", 11, 4, 4, 4, 23),
    Case("llama", "unrelated", 9, 2, 5, 4, 23),
    Case("llama", "unrelated", 3, 3, 3, 8, 1),
    Case("llama", "perturbed", 11, 3, None, 8, 13),
    Case("llama", "perturbed", 17, 8, 8, 5, 31),
    Case("llama", "perturbed", 20, 8, 16, 4, 23),
    Case("llama", "perturbed", 5, 2, 2, 1, 23),
    Case("qwen2", "identical", 8, 8, None, 8, 1),
    Case("qwen2", "identical", 12, 3, 9, 4, 40),
    Case("qwen2", "unrelated", 10, 8, 10, 1, 13),
    Case("qwen2", "unrelated", 2, 1, 1, 8, 23),
    Case("qwen2", "perturbed", 11, 4, None, 1, 23),
    Case("qwen2", "perturbed", 13, 2, 7, 8, 13),
    Case("qwen2", "perturbed", 8, 8, 8, 4, 5),
    Case("qwen3", "identical", 6, 2, 4, 4, 23),
    Case("qwen3", "unrelated", 5, 2, None, 4, 13),
    Case("qwen3", "perturbed", 11, 3, 6, 4, 23),
    Case("mistral", "identical", 6, 3, None, 8, 13),
    Case("mistral", "unrelated", 4, 2, 3, 1, 13),
    Case("mistral", "perturbed", 12, 4, 8, 5, 23),
]


def _case_id(c: Case) -> str:
    return f"{c.target}-{c.draft}-n{c.n_prompts}-b{c.batch_size}-w{c.window}-k{c.k}-m{c.max_new}"


def _run(bs, bundle, draft_kind, prompts, **kw):
    kw.setdefault("check_invariants", True)
    kw.setdefault("method", X)
    kw.setdefault("proposer", "draft")  # the draft model's cache in the window; lookups: test_proposers.py
    return bs.generate(bundle.target, bundle.drafts[draft_kind], prompts, **kw)


def test_case_list_covers_every_value():
    for target in tiny_models.TARGET_KINDS:
        assert {c.draft for c in CASES if c.target == target} == set(tiny_models.DRAFT_KINDS)
    assert {1, 2, 3, 8} <= {c.batch_size for c in CASES}
    assert any(c.n_prompts > c.batch_size for c in CASES)
    assert {1, 4, 8} <= {c.k for c in CASES}
    assert {1, 13, 23} <= {c.max_new for c in CASES}
    assert any(c.window == c.batch_size for c in CASES)
    assert any(c.window is not None and c.window > c.batch_size for c in CASES)
    assert any(c.window is None for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case: Case, bs, bundles, make_prompts, reference, check):
    bundle = bundles[case.target]
    prompts = make_prompts(bundle, case.n_prompts, seed=2000 + CASES.index(case))
    with forward_log(bundle.target) as verifies:
        result = _run(
            bs,
            bundle,
            case.draft,
            prompts,
            batch_size=case.batch_size,
            window_size=case.window,
            max_new_tokens=case.max_new,
            num_draft_tokens=case.k,
        )
    refs = [reference(bundle.target, p, case.max_new, bundle.eos_id) for p in prompts]
    check.result_matches(result, prompts, refs, case.max_new, bundle.eos_id)
    check.stats_consistent(result, X, case.k)
    # every round is one target forward (its verification): rounds, rows and realignments recounted from those
    st = result.stats
    assert st.rounds == len(verifies)
    assert st.rows_per_round_histogram == Counter(call.rows for call in verifies)
    assert st.row_rounds == sum(call.rows for call in verifies)
    assert max(call.rows for call in verifies) <= case.batch_size
    assert st.realignments == sum(len(set(call.attended)) > 1 for call in verifies), "rows of different lengths"


@pytest.mark.parametrize("sort_by_length", [True, False])
@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_pad_and_eos_inside_prompts(target, sort_by_length, bs, bundles, reference, check):
    bundle = bundles[target]
    eos, pad = bundle.eos_id, bundle.pad_id
    x = next(t for t in range(5, tiny_models.VOCAB_SIZE) if t not in (eos, pad))
    prompts = [[eos], [pad, pad, x], [pad], [eos, eos, pad], [x, pad], [x, eos], [pad] * 10 + [x], [pad, x]]
    result = _run(
        bs, bundle, "perturbed", prompts, batch_size=3, window_size=6, max_new_tokens=13, num_draft_tokens=4,
        pad_token_id=pad, sort_by_length=sort_by_length,
    )
    refs = [reference(bundle.target, p, 13, eos) for p in prompts]
    check.result_matches(result, prompts, refs, 13, eos)


def _uniform_prompts(bundle, n: int, length: int, seed: int) -> list[list[int]]:
    return make_prompts_for(bundle, n, seed=seed, min_len=length, max_len=length, specials=False)


@pytest.mark.parametrize("target", ["llama", "qwen2"])  # a property of the scheduler; thresholds measured on these
def test_grouping_rate_uniform_versus_mixed_lengths(target, bs, bundles, reference, check):
    bundle = bundles[target]
    kw = dict(batch_size=4, window_size=16, max_new_tokens=23, num_draft_tokens=4, eos_token_id=[])
    uniform = _uniform_prompts(bundle, 16, 20, seed=7)
    mixed = make_prompts_for(bundle, 16, seed=8, specials=False)
    results = {}
    for name, prompts in (("uniform", uniform), ("mixed", mixed)):
        result = _run(bs, bundle, "perturbed", prompts, **kw)
        refs = [reference(bundle.target, p, 23, []) for p in prompts]
        check.result_matches(result, prompts, refs, 23, [])
        results[name] = result.stats
    uniform_st, mixed_st = results["uniform"], results["mixed"]
    assert uniform_st.ragged_rounds > 0, "acceptance must be ragged for grouping to matter"
    # measured: 0.65 (llama) and 0.56 (qwen2) for one length, 0.04 and 0.02 for mixed lengths
    assert uniform_st.grouping_rate >= 0.5, uniform_st.to_dict()
    assert uniform_st.grouping_rate > mixed_st.grouping_rate + 0.3, (uniform_st.grouping_rate, mixed_st.grouping_rate)
    assert mixed_st.realignments > uniform_st.realignments


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_lockstep_group_copies_nothing(target, bs, bundles, reference, check):
    """The identical draft accepts everything, so equal-length rows stay together and keep their storage."""
    bundle = bundles[target]
    prompts = _uniform_prompts(bundle, 8, 12, seed=9)
    result = _run(
        bs, bundle, "identical", prompts, batch_size=4, window_size=8, max_new_tokens=21, num_draft_tokens=4,
        eos_token_id=[],
    )
    refs = [reference(bundle.target, p, 21, []) for p in prompts]
    check.result_matches(result, prompts, refs, 21, [])
    st = result.stats
    assert st.realignments == 0 and st.grouping_rate == 1.0
    # each group is laid out once, when its prompts are read (two reads: one per group), and every round of the
    # group then decodes in that storage: no KV is ever copied
    assert st.prefill_chunks == 2 and st.cache_gathers == 0, st.to_dict()
    assert st.recomputed_columns == 0 and st.rounds >= 2 * 5


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_sequences_finishing_at_very_different_times(target, bs, bundles, reference, check):
    bundle = bundles[target]
    prompts = make_prompts_for(bundle, 12, seed=10, min_len=1, max_len=45)
    budgets_result = []
    for max_new in (1, 2, 37):
        result = _run(bs, bundle, "perturbed", prompts, batch_size=3, window_size=5, max_new_tokens=max_new,
                      num_draft_tokens=5)
        refs = [reference(bundle.target, p, max_new, bundle.eos_id) for p in prompts]
        check.result_matches(result, prompts, refs, max_new, bundle.eos_id)
        budgets_result.append(result)
    lengths = [len(s) for s in budgets_result[-1].sequences]
    assert min(lengths) <= 12 and max(lengths) == 37, lengths


def test_same_output_as_eqspec_and_autoregressive(bs, qwen2, make_prompts):
    prompts = make_prompts(qwen2, 10, seed=11)
    outputs = {
        method: bs.generate(
            qwen2.target, qwen2.drafts["perturbed"], prompts, method=method, batch_size=3, max_new_tokens=17,
            num_draft_tokens=3,
        ).sequences
        for method in ("autoregressive", "eqspec", "exspec")
    }
    assert outputs["exspec"] == outputs["eqspec"] == outputs["autoregressive"]


def test_window_smaller_than_batch_is_rejected(bs, llama):
    with pytest.raises(ValueError, match="window_size must be >= batch_size"):
        _run(bs, llama, "identical", [[1, 2]], batch_size=4, window_size=3)
    with pytest.raises(ValueError, match="window_size must be an integer"):
        _run(bs, llama, "identical", [[1, 2]], batch_size=4, window_size=4.5)


def test_default_window_is_a_multiple_of_the_batch():
    assert SpecConfig(method=X, batch_size=3).window == 12
    assert SpecConfig(method=X, batch_size=3, window_size=5).window == 5


def test_pool_refills_in_length_order_and_check_catches_a_lost_row():
    rows = [Sequence(i, [1] * n, 4) for i, n in enumerate([5, 2, 9, 2, 7])]
    scheduler = PooledWindow(batch_size=3, window=3, sort_by_length=True)
    for row in rows:
        scheduler.add(row)
    assert sorted(r.index for r in scheduler.select()) == [0, 1, 3]
    pool = scheduler.pool
    assert [r.index for r in pool.window] == [1, 3, 0]
    pool.check(total=5)
    pool.window.pop()
    with pytest.raises(InvariantError, match="lost or duplicated"):
        pool.check(total=5)


def test_starving_row_is_served():
    """A row alone at its length still runs within the patience bound, even while groups keep forming."""
    rows = [Sequence(i, [1] * (3 if i else 9), 4) for i in range(9)]
    scheduler = PooledWindow(batch_size=4, window=9, sort_by_length=True)
    for row in rows:
        scheduler.add(row)
    picked = [r.index for r in scheduler.select()]
    pool = scheduler.pool
    assert 0 not in picked and len(picked) == 4
    pool.waited[0] = 2 * 3  # patience for W=9, B=4
    assert 0 in [r.index for r in pool.select(batch_size=4)]


def test_check_invariants_off_gives_same_output(bs, llama, make_prompts, reference, check):
    prompts = make_prompts(llama, 9, seed=12)
    result = _run(bs, llama, "perturbed", prompts, batch_size=4, max_new_tokens=23, num_draft_tokens=4,
                  check_invariants=False)
    refs = [reference(llama.target, p, 23, llama.eos_id) for p in prompts]
    check.result_matches(result, prompts, refs, 23, llama.eos_id)
    assert 0.0 < result.stats.gather_s <= result.stats.realign_s
