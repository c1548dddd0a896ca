"""Output equivalence: batchspec.generate must reproduce batch-size-1 greedy decoding token for token.

Every case runs with ``check_invariants=True``. The parameter space (target x draft kind x method x
batch layout x num_draft_tokens x max_new_tokens) is covered by a hand-chosen list of cases in
which every value of every parameter occurs, instead of the full cartesian product.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import pytest
import tiny_models
import torch
from helpers import Checks, forward_log, make_prompts_for, reference_greedy, replay_eqspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchspec.engine.core import Engine
from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import GROWTH, BatchKVCache
from batchspec.engine.runner import ModelRunner


class Case(NamedTuple):
    target: str  # one of tiny_models.TARGET_KINDS
    draft: str | None  # "identical" | "unrelated" | "perturbed" | None
    method: str  # "eqspec" | "autoregressive"
    n_prompts: int
    batch_size: int
    k: int  # num_draft_tokens
    max_new: int


E, X, A = "eqspec", "exspec", "autoregressive"

CASES = [
    # ---- eqspec, llama
    Case("llama", "identical", E, 3, 1, 1, 13),
    Case("llama", "identical", E, 8, 8, 8, 23),
    Case("llama", "identical", E, 11, 4, 4, 1),
    Case("llama", "unrelated", E, 5, 2, 4, 23),
    Case("llama", "unrelated", E, 11, 4, 8, 13),
    Case("llama", "unrelated", E, 3, 3, 1, 1),
    Case("llama", "perturbed", E, 6, 3, 8, 13),
    Case("llama", "perturbed", E, 11, 4, 4, 23),
    Case("llama", "perturbed", E, 4, 2, 1, 23),
    Case("llama", "perturbed", E, 1, 1, 4, 13),
    Case("llama", "perturbed", E, 8, 8, 8, 1),
    Case("llama", "perturbed", E, 5, 5, 8, 5),  # k larger than the whole budget
    # ---- eqspec, qwen2
    Case("qwen2", "identical", E, 6, 3, 4, 23),
    Case("qwen2", "identical", E, 4, 2, 1, 13),
    Case("qwen2", "identical", E, 8, 8, 8, 1),
    Case("qwen2", "unrelated", E, 8, 8, 4, 13),
    Case("qwen2", "unrelated", E, 2, 1, 8, 23),
    Case("qwen2", "unrelated", E, 11, 4, 1, 23),
    Case("qwen2", "perturbed", E, 8, 8, 1, 13),
    Case("qwen2", "perturbed", E, 11, 4, 8, 23),
    Case("qwen2", "perturbed", E, 3, 3, 4, 13),
    Case("qwen2", "perturbed", E, 2, 2, 8, 1),
    Case("qwen2", "perturbed", E, 3, 1, 8, 23),
    Case("qwen2", "identical", E, 8, 8, 4, 40),  # long enough for many EOS hits
    Case("llama", "perturbed", E, 17, 8, 5, 31),  # default k, two full batches and a partial one
    # ---- autoregressive (the draft, when given, must be ignored)
    Case("llama", None, A, 3, 1, 4, 13),
    Case("llama", "identical", A, 4, 2, 1, 23),
    Case("llama", "unrelated", A, 7, 3, 8, 1),
    Case("llama", "perturbed", A, 8, 8, 4, 23),
    Case("llama", None, A, 11, 4, 4, 13),
    Case("qwen2", None, A, 2, 1, 4, 23),
    Case("qwen2", "perturbed", A, 5, 2, 4, 13),
    Case("qwen2", None, A, 6, 3, 4, 23),
    Case("qwen2", "unrelated", A, 8, 8, 1, 1),
    Case("qwen2", "identical", A, 11, 4, 8, 23),
    # ---- qwen3 and mistral (appended, so that the seeds of the cases above stay as they were)
    Case("qwen3", "identical", E, 5, 2, 4, 23),
    Case("qwen3", "unrelated", E, 6, 3, 8, 13),
    Case("qwen3", "perturbed", E, 9, 4, 4, 23),
    Case("qwen3", None, A, 4, 2, 4, 13),
    Case("mistral", "identical", E, 4, 4, 8, 13),
    Case("mistral", "unrelated", E, 5, 2, 1, 23),
    Case("mistral", "perturbed", E, 11, 4, 5, 23),
    Case("mistral", "perturbed", A, 6, 3, 4, 23),
]


def _case_id(c: Case) -> str:
    return f"{c.target}-{c.draft or 'nodraft'}-{c.method}-n{c.n_prompts}-b{c.batch_size}-k{c.k}-m{c.max_new}"


def _run(bs, bundle, draft, prompts, **kw):
    """``batchspec.generate`` with the draft model proposing (these tests exercise its cache and the realignment of
    both caches; the lookup and hybrid proposers have their own matrix in ``test_proposers.py``)."""
    kw.setdefault("check_invariants", True)
    if draft is not None:
        kw.setdefault("proposer", "draft")
    return bs.generate(bundle.target, draft, prompts, **kw)


def _run_checked(bs, bundle, draft, prompts, *, method, batch_size, max_new, k, eos=None, **kw):
    """:func:`_run` (invariants checked every round unless ``kw`` says otherwise), then its outputs compared token
    for token with the independent reference, transformers' own greedy ``generate`` of every prompt alone
    (:func:`reference_greedy`), and its stats checked for consistency. ``eos``: an ``eos_token_id`` to pass (else
    the bundle's). Returns the result."""
    if eos is not None:
        kw["eos_token_id"] = eos
    result = _run(bs, bundle, draft, prompts, method=method, batch_size=batch_size, max_new_tokens=max_new,
                  num_draft_tokens=k, **kw)
    eos = bundle.eos_id if eos is None else eos
    refs = [reference_greedy(bundle.target, p, max_new, eos) for p in prompts]
    Checks.result_matches(result, prompts, refs, max_new, eos)
    Checks.stats_consistent(result, method, k)
    return result


def test_case_list_covers_every_value():
    assert {c.target for c in CASES} == set(tiny_models.TARGET_KINDS)
    for t in tiny_models.TARGET_KINDS:
        assert {c.draft for c in CASES if c.target == t and c.method == E} == set(tiny_models.DRAFT_KINDS)
    assert {c.method for c in CASES} == {E, A}
    assert {1, 2, 3, 8} <= {c.batch_size for c in CASES}
    assert {1, 2, 3, 8} <= {c.batch_size for c in CASES if c.n_prompts == c.batch_size}
    assert any(c.n_prompts > c.batch_size and c.n_prompts % c.batch_size for c in CASES)
    assert {1, 4, 8} <= {c.k for c in CASES if c.method == E}
    assert {1, 13, 23} <= {c.max_new for c in CASES}
    assert any(c.max_new % c.k and c.k > 1 for c in CASES if c.method == E)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case: Case, bs, bundles):
    bundle = bundles[case.target]
    draft = bundle.drafts[case.draft] if case.draft else None
    seed = 1000 + CASES.index(case)
    prompts = make_prompts_for(bundle, case.n_prompts, seed=seed)
    _run_checked(bs, bundle, draft, prompts, method=case.method, batch_size=case.batch_size, max_new=case.max_new,
                 k=case.k)


# --------------------------------------------------------------------------------------------------
# draft kinds


def _accepts_everything(st_, k: int, max_new: int) -> None:
    assert st_.draft_tokens_proposed > 0
    assert st_.draft_tokens_accepted == st_.draft_tokens_proposed
    # speculation must actually save rounds: with everything accepted a round emits >= k tokens per row
    assert st_.rounds <= math.ceil(max_new / k) + 1, st_.rounds
    assert st_.mean_tokens_per_row_round > 2.0
    assert max(st_.accepted_length_histogram) == k


def _accepts_little(st_, k: int, max_new: int) -> None:
    assert st_.draft_tokens_proposed > 0
    assert st_.acceptance_rate < 0.3


def _ragged_and_partial(st_, k: int, max_new: int) -> None:
    assert st_.ragged_rounds > 0, "rows of one batch should accept different numbers of draft tokens"
    assert 0.15 < st_.acceptance_rate < 0.95, st_.acceptance_rate
    assert len([c for c in st_.accepted_length_histogram.values() if c > 0]) >= 2


DRAFT_KIND_CASES = [
    # draft kind, prompt seed, prompts, batch size, what its acceptance must look like
    pytest.param("identical", 21, 6, 6, _accepts_everything, id="identical-accepts-everything"),
    pytest.param("unrelated", 22, 6, 3, _accepts_little, id="unrelated-low-acceptance-same-output"),
    pytest.param("perturbed", 23, 8, 8, _ragged_and_partial, id="perturbed-ragged-and-partial"),
]


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
@pytest.mark.parametrize(("draft_kind", "seed", "n", "batch_size", "acceptance"), DRAFT_KIND_CASES)
def test_draft_kind(target, draft_kind, seed, n, batch_size, acceptance, bs, bundles):
    """Every draft kind gives the target's own output; how much of its drafts is accepted depends on the kind."""
    bundle = bundles[target]
    k, max_new = 4, 23
    prompts = make_prompts_for(bundle, n, seed=seed)
    result = _run_checked(bs, bundle, bundle.drafts[draft_kind], prompts, method=E, batch_size=batch_size,
                          max_new=max_new, k=k)
    acceptance(result.stats, k, max_new)


# --------------------------------------------------------------------------------------------------
# special tokens, EOS handling, lengths


def _special_prompts(bundle) -> list[list[int]]:
    eos, pad = bundle.eos_id, bundle.pad_id
    x = next(t for t in range(5, tiny_models.VOCAB_SIZE) if t not in (eos, pad))
    long_ = make_prompts_for(bundle, 1, seed=77, min_len=45, max_len=45, specials=False)[0]
    long_[::7] = [pad] * len(long_[::7])
    long_[3::11] = [eos] * len(long_[3::11])
    return [
        [eos],
        [pad, pad, x],
        [pad],
        [eos, eos, pad],
        [x, pad],
        [x, eos],
        long_,
        [pad] * 10 + [x],
    ]


@pytest.mark.parametrize(
    ("target", "method", "draft_kind", "pad_choice"),
    [
        ("llama", E, "perturbed", "pad"),
        ("llama", E, "identical", "eos"),
        ("llama", A, None, "pad"),
        ("qwen2", E, "perturbed", "eos"),
        ("qwen2", E, "unrelated", "pad"),
        ("qwen2", A, None, "default"),
    ],
)
def test_pad_and_eos_inside_prompts(target, method, draft_kind, pad_choice, bs, bundles):
    bundle = bundles[target]
    prompts = _special_prompts(bundle)
    pad_token_id = {"pad": bundle.pad_id, "eos": bundle.eos_id, "default": None}[pad_choice]
    if pad_token_id is not None:
        assert any(pad_token_id in p for p in prompts)
    max_new, k = 13, 4
    draft = bundle.drafts[draft_kind] if draft_kind else None
    result = _run_checked(bs, bundle, draft, prompts, method=method, batch_size=4, max_new=max_new, k=k,
                          pad_token_id=pad_token_id)
    # a prompt that ends with EOS does not end the generation
    assert len(result.sequences[0]) >= 1


@pytest.fixture(scope="module")
def early_eos_prompts(bundles):
    """Per target: prompts whose reference (23 tokens) hits EOS at index 1..6, and prompts that don't."""
    out = {}
    for kind, bundle in bundles.items():
        early, none = [], []
        for p in make_prompts_for(bundle, 80, seed=5):
            r = reference_greedy(bundle.target, p, 23, bundle.eos_id)
            if r and r[-1] == bundle.eos_id and 1 <= len(r) - 1 <= 6:
                early.append(p)
            elif len(r) == 23 and bundle.eos_id not in r:
                none.append(p)
            if len(early) >= 3 and len(none) >= 3:
                break
        assert len(early) >= 2, f"{kind}: no prompt with an early EOS; adjust the prompt seed"
        out[kind] = (early[:3], none[:3])
    return out


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "mixed"])
def test_eos_inside_accepted_draft_run(target, alone, bs, bundles, early_eos_prompts):
    bundle = bundles[target]
    early, none = early_eos_prompts[target]
    k, max_new = 8, 23
    prompts = [early[0]] if alone else [none[0], early[0], none[1], early[1]]
    result = _run_checked(bs, bundle, bundle.drafts["identical"], prompts, method=E, batch_size=len(prompts),
                          max_new=max_new, k=k)
    for i, p in enumerate(prompts):
        if p in early:
            seq = result.sequences[i]
            assert seq[-1] == bundle.eos_id and len(seq) <= 7
            assert bundle.eos_id not in seq[:-1]
            assert result.finish_reasons[i] == "eos"
        else:
            assert len(result.sequences[i]) == max_new
            assert result.finish_reasons[i] == "length"
    assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("method", [E, A])
def test_lengths_and_finish_reasons(method, bs, qwen2):
    bundle = qwen2
    max_new, k = 40, 4
    prompts = make_prompts_for(bundle, 11, seed=31)
    result = _run_checked(bs, bundle, bundle.drafts["perturbed"], prompts, method=method, batch_size=4,
                          max_new=max_new, k=k)
    reasons = result.finish_reasons
    assert set(reasons) == {"eos", "length"}, "this prompt set must exercise both outcomes"
    for seq, reason in zip(result.sequences, reasons, strict=True):
        assert len(seq) <= max_new
        if reason == "length":
            assert len(seq) == max_new and seq[-1] != bundle.eos_id
        else:
            assert seq[-1] == bundle.eos_id and bundle.eos_id not in seq[:-1]


@pytest.mark.parametrize(("target", "method"), [("llama", E), ("qwen2", E), ("llama", A)])
def test_eos_list_of_two_ids(target, method, bs, bundles):
    bundle = bundles[target]
    # second EOS: the most frequent generated token other than the EOS and pad ids
    counts: dict[int, int] = {}
    for _, cont in bundle.probe:
        for t in set(cont[2:]):
            counts[t] = counts.get(t, 0) + 1
    eos2 = max((t for t in counts if t not in (bundle.eos_id, bundle.pad_id)), key=lambda t: (counts[t], -t))
    eos_list = [bundle.eos_id, eos2]
    max_new, k = 23, 4
    prompts = make_prompts_for(bundle, 10, seed=41)
    result = _run_checked(bs, bundle, bundle.drafts["perturbed"], prompts, method=method, batch_size=4,
                          max_new=max_new, k=k, eos=eos_list)
    last = {s[-1] for s, r in zip(result.sequences, result.finish_reasons, strict=True) if r == "eos"}
    assert eos2 in last, "the second EOS id must end at least one sequence in this prompt set"


@pytest.mark.parametrize("method", [E, A])
def test_explicit_eos_overrides_generation_config(method, bs, llama):
    bundle = llama
    other_eos = bundle.pad_id  # a frequent token, different from the configured EOS
    assert other_eos != bundle.target.generation_config.eos_token_id
    max_new, k = 23, 4
    prompts = make_prompts_for(bundle, 6, seed=51)
    result = _run_checked(bs, bundle, bundle.drafts["perturbed"], prompts, method=method, batch_size=3,
                          max_new=max_new, k=k, eos=other_eos)
    assert any(r == "eos" for r in result.finish_reasons)


def test_deterministic_and_order_preserving(bs, llama, make_prompts, check):
    bundle = llama
    prompts = make_prompts(bundle, 9, seed=61)
    kw = dict(method=E, batch_size=4, max_new_tokens=13, num_draft_tokens=4)
    a = _run(bs, bundle, bundle.drafts["perturbed"], prompts, **kw)
    b = _run(bs, bundle, bundle.drafts["perturbed"], prompts[::-1], **kw)
    assert a.sequences == b.sequences[::-1]
    assert a.finish_reasons == b.finish_reasons[::-1]


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_stats_agree_with_a_replay_and_the_clock(target, bs, bundles, make_prompts, check):
    """The counters against an independent recount, the stage times against clocks outside the stages."""
    bundle = bundles[target]
    draft = bundle.drafts["perturbed"]
    prompts = make_prompts(bundle, 7, seed=71)
    kw = dict(batch_size=3, max_new_tokens=23, num_draft_tokens=4)
    for method in (E, A):
        with forward_log(bundle.target) as verifies, forward_log(draft) as drafts:
            started = time.perf_counter()
            result = _run(bs, bundle, draft, prompts, method=method, **kw)
            elapsed = time.perf_counter() - started
        st_ = result.stats
        assert st_.rounds == len(verifies), "one target forward (the verification) per round"
        assert st_.row_rounds == sum(call.rows for call in verifies)
        if method == A:
            assert not drafts and st_.generated_tokens == st_.row_rounds
            check.clock_consistent(result, elapsed, {"verify": verifies})
            continue
        replay = replay_eqspec(bundle.target, draft, prompts, batch_size=3, k=4, max_new=23, eos=bundle.eos_id)
        assert result.sequences == replay.outputs
        assert (st_.rounds, st_.row_rounds) == (replay.rounds, replay.row_rounds)
        assert st_.ragged_rounds == replay.ragged_rounds
        assert (st_.draft_tokens_proposed, st_.draft_tokens_accepted) == (replay.proposed, replay.accepted)
        assert st_.accepted_length_histogram == dict(replay.histogram)
        assert st_.acceptance_rate == replay.accepted / replay.proposed
        assert 0 < replay.accepted < replay.proposed and replay.ragged_rounds > 0, "a partial, ragged run"
        check.clock_consistent(result, elapsed, {"verify": verifies, "draft": drafts})


# --------------------------------------------------------------------------------------------------
# randomized cases


@pytest.mark.parametrize(("target", "method"), [("llama", E), ("qwen2", E), ("llama", A)])
def test_long_prompts_beyond_initial_cache_capacity(target, method, bs, bundles):
    """Prompts of ~250-300 tokens plus generation run past any small initial KV allocation."""
    bundle = bundles[target]
    prompts = [
        make_prompts_for(bundle, 1, seed=90 + i, min_len=n, max_len=n, specials=False)[0]
        for i, n in enumerate((1, 300, 250, 31, 255))
    ]
    prompts[1][100] = bundle.pad_id
    prompts[2][-1] = bundle.eos_id
    _run_checked(bs, bundle, bundle.drafts["perturbed"], prompts, method=method, batch_size=3, max_new=40, k=8)


@pytest.mark.parametrize("method", [E, X, A])
def test_prompts_of_different_lengths_are_read_in_length_groups(method, bs, llama, monkeypatch):
    """Prompts of 3-5 and 39-41 tokens are read in two groups, not padded to 41 in one forward, and the output
    stays the reference's."""
    read: list[tuple[int, int]] = []
    read_columns = ModelRunner.read

    def spy(runner, model, batch, cache, inputs):
        if model is llama.target:
            read.append(tuple(inputs.shape))
        return read_columns(runner, model, batch, cache, inputs)

    monkeypatch.setattr(ModelRunner, "read", spy)
    prompts = [
        make_prompts_for(llama, 1, seed=80 + i, min_len=n, max_len=n, specials=False)[0]
        for i, n in enumerate((3, 40, 5, 41, 4, 39))
    ]
    _run_checked(bs, llama, llama.drafts["perturbed"], prompts, method=method, batch_size=6, max_new=9, k=3)
    assert sorted(read) == [(3, 4), (3, 40)], read


@pytest.mark.parametrize(("method", "draft_kind", "batch_size"), [(E, "perturbed", 1), (X, "identical", 3)])
def test_kv_storage_grows_past_its_spare_columns(method, draft_kind, batch_size, bs, llama, monkeypatch):
    """Rows in lockstep keep their storage round after round, so a long enough generation fills its ``GROWTH``
    spare columns and the storage must grow in place of a realignment's fresh allocation."""
    grown: dict[int, list[tuple[int, int]]] = {}
    ensure_capacity = BatchKVCache.ensure_capacity

    def spy(cache, key_states, needed):
        before = None if cache.storage is None else cache.storage.shape[4]
        storage = ensure_capacity(cache, key_states, needed)
        if before is not None and storage.shape[4] != before:
            grown.setdefault(id(cache), []).append((before, storage.shape[4]))
        return storage

    monkeypatch.setattr(BatchKVCache, "ensure_capacity", spy)
    prompts = make_prompts_for(llama, batch_size, seed=97, min_len=9, max_len=9, specials=False)
    _run_checked(bs, llama, llama.drafts[draft_kind], prompts, method=method, batch_size=batch_size,
                 max_new=GROWTH + 40, k=6, eos=[])
    assert len(grown) >= 2, f"the target's and the draft's storage must both grow: {grown}"
    assert all(after > before for steps in grown.values() for before, after in steps), grown


@pytest.mark.parametrize("method", [E, A])
def test_same_output_without_invariant_checks(method, bs, qwen2):
    prompts = make_prompts_for(qwen2, 9, seed=95)
    _run_checked(bs, qwen2, qwen2.drafts["perturbed"], prompts, method=method, batch_size=4, max_new=23, k=4,
                 check_invariants=False)


@pytest.mark.parametrize("method", [E, A])
def test_check_invariants_finds_a_broken_one(method, bs, qwen2, monkeypatch):
    """A row whose output gains a token its stored stream lacks (broken on purpose after the first round) is found
    by ``check_invariants=True`` with a named error, also under ``python -O`` (the checks raise, they do not
    assert)."""
    accept = Engine.accept

    def corrupting(engine, *args, **kwargs):
        result = accept(engine, *args, **kwargs)
        rows = [row for row in args[0].rows if not row.finished]
        rows[0].output.append(rows[0].output[-1] if rows[0].output else 0)
        return result

    monkeypatch.setattr(Engine, "accept", corrupting)
    prompts = make_prompts_for(qwen2, 3, seed=95)
    with pytest.raises(InvariantError, match="row 0: target KV misses columns"):
        bs.generate(qwen2.target, qwen2.drafts["perturbed"], prompts, method=method, batch_size=3, max_new_tokens=12,
                    num_draft_tokens=3, check_invariants=True)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    target=st.sampled_from(tiny_models.TARGET_KINDS),
    draft_kind=st.sampled_from(tiny_models.DRAFT_KINDS),
    method=st.sampled_from([E, E, X, X, A]),
    n=st.integers(1, 9),
    batch_size=st.integers(1, 6),
    window_extra=st.none() | st.integers(0, 6),
    sort_by_length=st.booleans(),
    k=st.integers(1, 10),
    max_new=st.integers(0, 24),
    seed=st.integers(0, 10_000),
    second_eos=st.booleans(),
)
def test_random_configurations(
    target, draft_kind, method, n, batch_size, window_extra, sort_by_length, k, max_new, seed, second_eos, bs,
    bundles,
):
    bundle = bundles[target]
    prompts = make_prompts_for(bundle, n, seed=seed, max_len=40)
    eos = [bundle.eos_id, bundle.pad_id] if second_eos else bundle.eos_id
    exspec = {} if method != X else {
        "window_size": None if window_extra is None else batch_size + window_extra, "sort_by_length": sort_by_length
    }
    _run_checked(bs, bundle, bundle.drafts[draft_kind], prompts, method=method, batch_size=batch_size,
                 max_new=max_new, k=k, eos=eos, **exspec)


# --------------------------------------------------------------------------------------------------
# the harness itself (runs without the engine)


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_reference_matches_naive_greedy_loop(target, bundles):
    bundle = bundles[target]
    model = bundle.target
    for p in make_prompts_for(bundle, 3, seed=81):
        ids = list(p)
        naive = []
        with torch.no_grad():
            for _ in range(15):
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                naive.append(nxt)
                ids.append(nxt)
                if nxt == bundle.eos_id:
                    break
        assert reference_greedy(model, p, 15, bundle.eos_id) == naive


@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_tiny_models_are_fit_for_purpose(target, bundles):
    bundle = bundles[target]
    info = tiny_models.validate_bundle(bundle)
    assert info["agree_identical"] == 1.0
    assert info["agree_unrelated"] < 0.1
    assert 0.3 < info["agree_perturbed"] < 0.9
    assert 0.1 < info["eos_hit_fraction"] < 0.7  # EOS happens, but not for every prompt
    assert info["distinct_tokens_mean"] > 15  # not stuck in short loops
    assert bundle.eos_id != bundle.pad_id
    assert bundle.target.generation_config.eos_token_id == bundle.eos_id
    assert bundle.target.dtype == torch.float64
    assert bundle.drafts["unrelated"].config.vocab_size == bundle.target.config.vocab_size


@pytest.mark.parametrize(("kind", "implementation"), [("gemma3", "sdpa"), ("gemma3", "eager"), ("gemma2", "eager"),
                                                       ("ministral", "sdpa"), ("ministral", "eager")])
def test_mixed_sliding_and_full_layers_on_the_float_forward_match_reference(kind, implementation, bs):
    """Gemma 3, Gemma 2 (its scores and logits soft-capped, by transformers' eager attention, which alone caps) and
    Ministral on transformers' forward (float64, no quantization): the runner hands their sliding and full layers a
    mask each (window 4 over prompts of up to 24 tokens), boolean for sdpa and additive for eager, and EqSpec gives
    each prompt the model's own greedy output."""
    build = {"gemma3": tiny_models.build_gemma3, "gemma2": tiny_models.build_gemma2,
             "ministral": tiny_models.build_ministral}[kind]
    target = build(seed=5)
    draft = tiny_models.perturbed_copy(build(seed=5), 0.05, seed=6)
    for model in (target, draft):
        model.config._attn_implementation = implementation
    prompts = tiny_models.random_prompts(5, seed=9, max_len=24)
    result = bs.generate(target, draft, prompts, method="eqspec", proposer="draft", batch_size=3, max_new_tokens=12,
                         num_draft_tokens=3, check_invariants=True)
    assert result.sequences == [reference_greedy(target, prompt, 12, None) for prompt in prompts]
