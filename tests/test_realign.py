"""Realignment alone: the layout arithmetic and the gather of tokens and KV caches.

Fake one-layer caches store, at every real column of a row, ``1000 * sequence index + position``; padding
columns hold -1. Rows sit in several source slabs at arbitrary start columns, as rounds leave them. After
``plan_layout`` + ``assemble`` every row must read as its unpadded sequence would: positions ``0, 1, ...`` at
its real columns up to the cached length, whatever its old slab, start, acceptance and the other rows did.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.realign import (
    DRAFT_SLACK,
    assemble,
    compact,
    draft_catch_up,
    layout_columns,
    placed,
    plan_layout,
)
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState, HostColumns, KVLocation, Moved, Sequence

CPU = torch.device("cpu")
RUNNER = ModelRunner(CPU)


def _assemble(layout, rows, layers):
    """:func:`assemble` with the layout's columns staged as the engine stages them."""
    staged = RUNNER.stage(*layout_columns(layout, rows, layers))
    return assemble(layout, rows, staged, filler=0, layers=layers)


def fake_cache(starts: list[int], columns: int, indices: list[int]) -> BatchKVCache:
    """One layer, one head, dim 1: column ``c`` of row ``r`` holds ``1000 * indices[r] + (c - starts[r])``."""
    cols = torch.arange(columns)
    begin = torch.tensor(starts)[:, None]
    value = (1000 * torch.tensor(indices)[:, None] + cols[None, :] - begin).double()
    value = torch.where(cols[None, :] >= begin, value, torch.full_like(value, -1.0))
    cache = BatchKVCache(num_layers=1)
    states = value[:, None, :, None]  # [B, H=1, columns, D=1]
    cache.layers[0].update(states, states.clone())
    return cache


def make_slab(rows: list[Sequence], starts: list[int], lags: list[int], draft_lags: list[int]) -> Slab:
    """A slab holding ``rows`` from ``starts``; row r's target KV covers all but ``lags[r]`` of its columns."""
    width = max(s + r.content_len for s, r in zip(starts, rows, strict=True)) + 2  # rejected-draft garbage
    tokens = torch.full((len(rows), width), -5, dtype=torch.long)
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        tokens[r, start : start + row.content_len] = torch.tensor(row.prompt + row.output)
    indices = [row.index for row in rows]
    slab = Slab(tokens, fake_cache(starts, width, indices), fake_cache(starts, width, indices), holders=tuple(rows))
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        row.kv = KVLocation(slab, r, start, row.content_len - 1 - lags[r], row.content_len - 1 - draft_lags[r])
    return slab


@st.composite
def scattered_rows(draw):
    """Rows spread over up to three slabs (or new, without KV), picked in a random order."""
    n = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(1, 25), min_size=n, max_size=n))
    rows = [Sequence(i, [100 * i + j for j in range(c)], max_new_tokens=8) for i, c in enumerate(lengths)]
    homes = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # 3: no KV yet
    for home in range(3):
        members = [row for row, h in zip(rows, homes, strict=True) if h == home]
        if members:
            starts = [draw(st.integers(0, 6)) for _ in members]
            lags = [draw(st.integers(0, 2)) if row.content_len > 3 else 0 for row in members]
            draft_lags = [draw(st.integers(0, 3)) if row.content_len > 4 else 0 for row in members]
            make_slab(members, starts, lags, draft_lags)
    return draw(st.permutations(rows))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(scattered_rows(), st.sampled_from([0, 4]))
def test_gathered_batch_holds_each_unpadded_row(rows, slack):
    layout = plan_layout(rows, slack=slack)
    batch = _assemble(layout, rows, (1, 1))
    if not slack:
        assert min(layout.pad) == 0, "the longest row sets the width and has no padding"
    _assert_unpadded(layout, batch, rows)


def _assert_unpadded(layout, batch, rows) -> None:
    """Every row of ``batch`` reads as its unpadded sequence: its cached keys and values and its positions."""
    batch.check()  # I1, I2, every row's token stream, cache lengths within the width
    for i, row in enumerate(rows):
        pad = layout.pad[i]
        cached = 0 if row.kv is None else row.kv.target_cached
        draft_held = 0 if row.kv is None else row.kv.draft_cached
        assert layout.target_len <= pad + cached
        assert int(batch.draft_cached[i]) <= draft_held
        assert batch.slab.target.length == layout.target_len and batch.slab.draft.length == layout.draft_len
        valid = ((batch.slab.target, layout.target_len), (batch.slab.draft, pad + int(batch.draft_cached[i])))
        for cache, length in valid:
            if length > pad:
                keys = cache.layers[0].keys[i, 0, pad:length, 0].tolist()
                values = cache.layers[0].values[i, 0, pad:length, 0].tolist()
                expected = [1000.0 * row.index + p for p in range(length - pad)]
                assert keys == expected and values == expected
        real = batch.position_ids(0, layout.width)[i, pad:].tolist()
        assert real == list(range(row.content_len))  # I2 over the real tokens


def test_worked_example_from_the_docstring():
    """k = 2, L = 5: row 0 (pad 2) accepted both drafts, row 1 (pad 0) rejected the first."""
    row0 = Sequence(0, [1, 2, 3], 8, output=[11, 12, 13])
    row1 = Sequence(1, [4, 5, 6, 7, 8], 8, output=[14])
    slab = make_slab([row0, row1], starts=[2, 0], lags=[0, 0], draft_lags=[0, 0])
    layout = plan_layout([row0, row1])
    assert layout.width == 6 and layout.pad == [0, 0]
    assert [s.shift for s in layout.sources] == [[-2, 0]]
    assert layout.reuse is None and not layout.padded
    batch = _assemble(layout, [row0, row1], (1, 1))
    assert batch.tokens.tolist() == [[1, 2, 3, 11, 12, 13], [4, 5, 6, 7, 8, 14]]
    assert batch.slab.target is not slab.target
    assert batch.slab.target.storage is slab.target.storage, "all of one slab's rows shift within its storage"
    assert batch.slab.target.layers[0].keys[0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4]  # row 0's columns moved left


def _eight_and_ten(starts: list[int]) -> list[Sequence]:
    """Rows of content 10, 8, 8 in one slab from ``starts``, each holding every column but its pending one."""
    rows = [Sequence(i, [50 * i + j for j in range(n)], 8) for i, n in enumerate([10, 8, 8])]
    make_slab(rows, starts=starts, lags=[0, 0, 0], draft_lags=[0, 0, 0])
    return rows


def test_with_slack_only_the_row_that_gained_more_moves_into_its_padding():
    """:func:`_width`'s example: ends ``[13, 12, 12]``, slack 4: width 12, row 0 moves one column left within the
    slab's storage and rows 1 and 2 stay; every row still reads as its unpadded sequence."""
    rows = _eight_and_ten([3, 4, 4])
    slab = rows[0].kv.slab
    before = slab.target.storage[:, :, 1:].clone()
    layout = plan_layout(rows, slack=4)
    assert layout.width == 12 and layout.pad == [2, 4, 4]
    assert [s.shift for s in layout.sources] == [[-1, 0, 0]] and layout.sources[0].moving == [0]
    batch = _assemble(layout, rows, (1, 1))
    batch.check()
    assert batch.slab.target.storage is slab.target.storage
    assert torch.equal(slab.target.storage[:, :, 1:, :, :11], before[:, :, :, :, :11]), "rows 1 and 2 were not touched"
    assert batch.slab.target.layers[0].keys[0, 0, 2:11, 0].tolist() == list(range(9))
    assert batch.moved == Moved(bytes=2 * (2 * 9 * 8), rows=1)  # both models: keys and values of 9 float64 columns


def test_with_slack_a_move_of_most_rows_pads_every_row_by_the_slack():
    """Ends ``[13, 12, 11]``: no end holds half the content, so all three move, to width 10 + 4."""
    rows = _eight_and_ten([3, 4, 3])
    layout = plan_layout(rows, slack=4)
    assert layout.width == 14 and layout.pad == [4, 6, 6]
    batch = _assemble(layout, rows, (1, 1))
    batch.check()
    for i, row in enumerate(rows):
        assert batch.slab.target.layers[0].keys[i, 0, layout.pad[i] : 13, 0].tolist() == [
            1000.0 * row.index + p for p in range(13 - layout.pad[i])]


def test_draft_catch_up_worked_example_from_its_docstring():
    """Catching up row 1 raises the columns the batch keeps, so row 2 lags as well."""
    rows = [Sequence(i, list(range(n)), 8) for i, n in enumerate([10, 10, 4])]
    make_slab(rows, starts=[0, 0, 6], lags=[0, 0, 0], draft_lags=[0, 6, 3])
    assert [row.kv.draft_cached for row in rows] == [9, 3, 0]
    assert plan_layout(rows, draft_slack=1).lagging == (1,)
    assert draft_catch_up(rows, draft_slack=1) == (1, 2)


@st.composite
def idle_draft_rows(draw):
    """Rows of one slab whose draft holds anything from none to all of their columns (they joined or took
    lookups while the draft was idle)."""
    n = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    rows = [Sequence(i, [100 * i + j for j in range(c)], max_new_tokens=8) for i, c in enumerate(lengths)]
    draft_lags = [draw(st.integers(0, c - 1)) for c in lengths]
    make_slab(rows, [max(lengths) - c for c in lengths], [0] * n, draft_lags)
    return rows


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(rows=idle_draft_rows(), slack=st.sampled_from([1, DRAFT_SLACK, 16]))
def test_after_draft_catch_up_no_row_lags(rows, slack):
    """Once the rows ``draft_catch_up`` names hold all their columns, the layout has no lagging row, so the draft's
    first forward (which feeds the columns after ``draft_len`` for every row) reads every row's missing columns.
    The rows lagging before are among them; the others keep the KV they have."""
    before = plan_layout(rows, draft_slack=slack).lagging
    chosen = draft_catch_up(rows, draft_slack=slack)
    assert set(before) <= set(chosen)
    held = [row.kv.draft_cached for row in rows]
    for i in chosen:
        rows[i].kv = replace(rows[i].kv, draft_cached=rows[i].content_len - 1)
    assert plan_layout(rows, draft_slack=slack).lagging == ()
    assert [row.kv.draft_cached for i, row in enumerate(rows) if i not in chosen] == [
        h for i, h in enumerate(held) if i not in chosen
    ]


def test_lockstep_rows_reuse_their_slab_without_a_copy():
    rows = [Sequence(i, [7] * 4, 8, output=[1, 2]) for i in range(3)]
    slab = make_slab(rows, starts=[0, 0, 0], lags=[0, 0, 0], draft_lags=[1, 1, 1])
    storage = slab.target.storage
    layout = plan_layout(rows)
    assert layout.reuse is slab
    batch = _assemble(layout, rows, (1, 1))
    assert batch.slab.target.storage is storage, "lockstep must not copy the cache"
    assert batch.slab.target.length == 5 and batch.slab.draft.length == 4
    assert batch.moved == Moved(0, 0)
    batch.check()


@pytest.mark.parametrize("order", [[1, 0, 2], [0, 1]], ids=["reordered", "subset"])
def test_reordered_or_partial_slab_is_gathered(order):
    rows = [Sequence(i, [7] * 4, 8) for i in range(3)]
    make_slab(rows, starts=[0, 0, 0], lags=[0, 0, 0], draft_lags=[0, 0, 0])
    picked = [rows[i] for i in order]
    layout = plan_layout(picked)
    assert layout.reuse is None and not layout.padded
    batch = _assemble(layout, picked, (1, 1))
    assert batch.slab.target.storage is not rows[0].kv.slab.target.storage, "other rows may still need that storage"
    assert batch.moved.rows == len(order)  # a gather copies every row, shifted or not


def test_the_rows_left_when_others_finished_move_up_within_their_storage():
    """Rows 0 and 2 of a slab whose row 1 finished: row 2 moves into row 1's place, row 0 stays; no storage is
    allocated, and the batch runs on the storage's first two rows."""
    rows = [Sequence(i, [7] * (4 + (i == 2)), 8) for i in range(3)]
    slab = make_slab(rows, starts=[1, 0, 0], lags=[0, 0, 0], draft_lags=[0, 0, 0])
    rows[1].retire("stop")
    picked = [rows[0], rows[2]]
    layout = plan_layout(picked)
    batch = _assemble(layout, picked, (1, 1))
    assert batch.slab.target.storage.data_ptr() == slab.target.storage.data_ptr()
    assert batch.slab.target.storage.shape[2] == 2
    assert batch.moved.rows == 1
    for cache in (batch.slab.target, batch.slab.draft):
        held = cache.storage[0, 0, :, 0, : cache.length, 0]  # [2, length]: 1000 * index + position
        assert held[0, 1:].tolist() == [0, 1, 2]
        assert held[1].tolist() == [2000, 2001, 2002, 2003]
    batch.check()


def test_placed_worked_example_from_its_docstring():
    """Rows 0, 1 and 3 of a slab (row 2 finished) and a new row: the new row takes row 2's place; without it, row 3
    does. Rows of another slab and rows that are not in the batch's first places follow, in the order given."""
    a, b, c, d = (Sequence(i, [7] * 4, 8) for i in range(4))
    make_slab([a, b, c, d], starts=[0] * 4, lags=[0] * 4, draft_lags=[0] * 4)
    c.retire("stop")
    e = Sequence(4, [9] * 3, 8)
    assert placed([a, b, d, e]) == [a, b, e, d]
    assert placed([d, b, a]) == [a, b, d]
    assert placed([e]) == [e]


@st.composite
def slab_with_joiners(draw):
    """A slab of 1..6 rows, some finished, and up to three rows joining (new, or from a slab of their own)."""
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    home = [Sequence(i, [100 * i + j for j in range(c)], 8) for i, c in enumerate(lengths)]
    starts = [draw(st.integers(0, 6)) for _ in home]
    lags = [draw(st.integers(0, 2)) if row.content_len > 3 else 0 for row in home]
    make_slab(home, starts, lags, [draw(st.integers(0, 3)) if row.content_len > 4 else 0 for row in home])
    finished = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    for row, done in zip(home, finished, strict=True):
        if done:
            row.retire("stop")
    joiners = [Sequence(10 + j, [100 * (10 + j) + t for t in range(draw(st.integers(1, 20)))], 8)
               for j in range(draw(st.integers(0, 3)))]
    elsewhere = [row for row in joiners if draw(st.booleans())]
    if elsewhere:
        make_slab(elsewhere, [0] * len(elsewhere), [0] * len(elsewhere), [0] * len(elsewhere))
    return draw(st.permutations([row for row in home if row.kv is not None] + joiners))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(slab_with_joiners(), st.sampled_from([0, 4]))
def test_rows_joining_a_slab_take_its_free_rows_without_a_new_storage(rows, slack):
    """Rows placed (:func:`placed`) in a slab whose rows finished: where its storage holds the batch, the batch runs
    in it, rows from elsewhere are copied into the free rows, and only those and the rows that shift or change rows
    are copied; every row reads as its unpadded sequence."""
    if not rows:
        return
    home = max({id(r.kv.slab): r.kv.slab for r in rows if r.kv}.values(),
               key=lambda slab: sum(r.kv is not None and r.kv.slab is slab for r in rows), default=None)
    rows = placed(rows)
    before = None if home is None else {row.index: (row.kv.row, row.kv.start) for row in rows
                                        if row.kv is not None and row.kv.slab is home}
    layout = plan_layout(rows, slack=slack)
    batch = _assemble(layout, rows, (1, 1))
    _assert_unpadded(layout, batch, rows)
    if home is None or len(rows) > home.size or layout.target_len == 0:  # no room, or no column kept: nothing to move
        return
    assert batch.slab.target.storage.data_ptr() == home.target.storage.data_ptr(), "no storage was allocated"
    copied = sum(1 for i, row in enumerate(rows) if row.kv is not None and (
        row.kv.slab is not home or before[row.index] != (i, layout.pad[i])))
    assert batch.moved.rows == copied


def test_a_row_joins_in_the_rows_a_batch_left_before():
    """A slab of three rows runs two (row 1 finished) on its storage's first two, then a new row joins: the batch
    grows back into the same storage, and the rows that run on do not move."""
    rows = [Sequence(i, [7] * (4 + i), 8) for i in range(3)]
    slab = make_slab(rows, starts=[2, 1, 0], lags=[0, 0, 0], draft_lags=[0, 0, 0])
    rows[1].retire("stop")
    two = placed([rows[0], rows[2]])
    layout = plan_layout(two)
    batch = _assemble(layout, two, (1, 1))
    assert batch.slab.target.storage.shape[2] == 2 and batch.moved.rows == 1  # row 2 into row 1's place
    for i, row in enumerate(two):
        row.kv = KVLocation(batch.slab, i, layout.pad[i], row.content_len - 1, row.content_len - 1)
    new = Sequence(5, [9] * 3, 8)
    three = placed([new, *two])
    assert three == [rows[0], rows[2], new]
    layout = plan_layout(three)
    batch = _assemble(layout, three, (1, 1))
    _assert_unpadded(layout, batch, three)
    assert batch.slab.target.storage.data_ptr() == slab.target.storage.data_ptr()
    assert batch.slab.target.storage.shape[2] == 3 and batch.moved.rows == 0


def test_new_rows_without_kv_start_from_zero_cache():
    old = Sequence(0, [3, 4, 5, 6], 8)
    make_slab([old], starts=[1], lags=[0], draft_lags=[0])
    new = Sequence(1, [9, 9], 8)
    layout = plan_layout([old, new])
    assert layout.fresh == (1,) and layout.padded
    assert layout.target_len == 2  # the new row's padding: the old row re-reads the rest
    assert layout.recomputed == 1  # the old row held 3 target columns and keeps 2
    batch = _assemble(layout, [old, new], (1, None))
    assert batch.slab.draft is None
    batch.check()


def test_check_catches_broken_invariants():
    rows = [Sequence(0, [5, 6, 7], 4), Sequence(1, [8], 4)]
    batch = _assemble(plan_layout(rows), rows, (1, 1))
    batch.check()
    broken = HostColumns(pad=[0, 1], content=batch.host.content, draft_cached=batch.host.draft_cached)
    with pytest.raises(InvariantError, match="I1 broken"):
        BatchState(rows, torch.tensor([0, 1]), batch.content, batch.slab, batch.draft_cached, broken).check()
    with pytest.raises(InvariantError, match="differs from the host's"):
        BatchState(rows, torch.tensor([0, 1]), batch.content, batch.slab, batch.draft_cached, batch.host).check()
    batch.slab.tokens[1, 2] = 9
    with pytest.raises(InvariantError, match="token stream out of sync"):
        batch.check()


def test_compact_moves_sparse_slab_rows_into_a_small_slab():
    rows = [Sequence(i, [10 * i + j for j in range(3 + i)], 8) for i in range(5)]
    dense = [Sequence(10 + i, [7] * 4, 8) for i in range(2)]
    sparse_slab = make_slab(rows, starts=[4, 3, 2, 1, 0], lags=[0, 0, 0, 0, 0], draft_lags=[0, 2, 0, 0, 0])
    dense_slab = make_slab(dense, starts=[0, 0], lags=[0, 0], draft_lags=[0, 0])
    live = [rows[3], rows[1], dense[0], dense[1]]  # 2 of 5 rows of one slab, both rows of the other
    before = {row.index: (row.kv.start, row.kv.target_cached, row.kv.draft_cached) for row in live}
    assert compact(live) == 1
    assert dense[0].kv.slab is dense_slab and dense[1].kv.slab is dense_slab
    small = rows[1].kv.slab
    assert small is rows[3].kv.slab and small is not sparse_slab and small.size == 2
    assert (rows[1].kv.row, rows[3].kv.row) == (0, 1)
    assert small.target.storage.shape[2] == 2 and small.target.length == sparse_slab.target.length
    for row in live:
        assert (row.kv.start, row.kv.target_cached, row.kv.draft_cached) == before[row.index]
        row.check_location()
    for row in (rows[1], rows[3]):  # the values moved with the rows: 1000 * index + column - start
        start, n = row.kv.start, row.kv.target_cached
        keys = small.target.storage[0, 0, row.kv.row, 0, start : start + n, 0]
        assert keys.tolist() == [1000.0 * row.index + c for c in range(n)]
        assert torch.equal(small.draft.storage[:, :, row.kv.row], sparse_slab.draft.storage[:, :, row.index])
    assert compact(live) == 0  # nothing sparse any more


def test_dropped_cache_frees_its_storage_without_the_cyclic_gc():
    """Slabs are replaced every realigned round; their storage must go as soon as the last reference does."""
    import gc
    import weakref

    cache = fake_cache([0, 1], 4, [0, 1])
    storage = weakref.ref(cache.storage)
    gc.disable()
    try:
        del cache
        assert storage() is None
    finally:
        gc.enable()
