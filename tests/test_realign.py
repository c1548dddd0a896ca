"""Realignment alone: the index arithmetic of unpad → append → repad and the KV-cache gather.

A fake one-layer cache stores, at every real column, ``1000 * row + position``; padding holds -1. After a
round each kept row must read as its unpadded sequence would: positions ``0 .. content' - 2`` at its real
columns, whatever its old padding, its acceptance and the other rows did.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.engine import _move_tokens
from batchspec.kv_cache import BatchKVCache
from batchspec.realign import plan_realign
from batchspec.state import BatchState, Sequence


@st.composite
def rounds(draw):
    """A batch after verification: pad/content lengths (I1 holds), k, gained tokens, kept rows."""
    size = draw(st.integers(1, 6))
    k = draw(st.integers(0, 6))
    content = draw(st.lists(st.integers(1, 30), min_size=size, max_size=size))
    gained = draw(st.lists(st.integers(1, k + 1), min_size=size, max_size=size))
    keep = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    return content, k, gained, keep


def fake_cache(pad: list[int], columns: int) -> BatchKVCache:
    """One layer, one head, dim 1: real column ``c`` of row ``i`` holds ``1000 * i + (c - pad[i])``."""
    cols = torch.arange(columns)
    rows = torch.arange(len(pad))
    pads = torch.tensor(pad)
    value = (1000 * rows[:, None] + cols[None, :] - pads[:, None]).double()
    value = torch.where(cols[None, :] >= pads[:, None], value, torch.full_like(value, -1.0))
    cache = BatchKVCache(num_layers=1)
    states = value[:, None, :, None]  # [B, H=1, columns, D=1]
    cache.layers[0].update(states, states.clone())
    return cache


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(rounds())
def test_realigned_cache_holds_each_unpadded_row(case):
    content, k, gained, keep = case
    width = max(content)
    pad = [width - c for c in content]
    # after verification the target cache holds L - 1 cached columns, the pending token and k drafts
    cache = fake_cache(pad, width + k)
    draft_valid = torch.full((len(pad),), width)
    plan = plan_realign(
        torch.tensor(pad), torch.tensor(content), torch.tensor(gained), torch.tensor(keep), draft_valid
    )
    if not any(keep):
        assert plan.size == 0
        return
    cache.realign(plan, plan.width - 1)
    assert cache.length == plan.width - 1
    kept = [i for i, kept_row in enumerate(keep) if kept_row]
    assert plan.rows.tolist() == kept
    keys = cache.layers[0].keys[:, 0, :, 0]  # [B', L' - 1]
    values = cache.layers[0].values[:, 0, :, 0]
    for b, i in enumerate(kept):
        new_pad, new_content = int(plan.pad[b]), int(plan.content[b])
        assert new_content == content[i] + gained[i]
        assert new_pad + new_content == plan.width  # I1
        expected = [1000.0 * i + p for p in range(new_content - 1)]
        assert keys[b, new_pad:].tolist() == expected
        assert values[b, new_pad:].tolist() == expected
    assert int(plan.pad.min()) == 0, "the widest kept row sets L' and has no padding"


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(rounds())
def test_moved_tokens_keep_invariants(case):
    content, k, gained, keep = case
    rows = [Sequence(i, [100 * i + j for j in range(c)], max_new_tokens=64) for i, c in enumerate(content)]
    batch = BatchState.from_sequences(rows, pad_token_id=7, device=torch.device("cpu"))
    batch.target_len = batch.width - 1
    batch.check()
    verdict_tokens = torch.tensor([[10_000 + 10 * i + j for j in range(k + 1)] for i in range(len(rows))])
    plan = plan_realign(
        batch.pad, batch.content, torch.tensor(gained), torch.tensor(keep), torch.zeros(len(rows), dtype=torch.long)
    )
    if plan.size == 0:
        return
    tokens = _move_tokens(batch.tokens, verdict_tokens, plan)
    kept = plan.rows.tolist()
    for i in kept:
        rows[i].output.extend(verdict_tokens[i, : gained[i]].tolist())
    moved = BatchState(
        rows=[rows[i] for i in kept],
        tokens=tokens,
        pad=plan.pad,
        content=plan.content,
        target_len=plan.width - 1,
        draft_len=plan.draft_len,
    )
    moved.check()  # I1, I2 and every row's token stream
    positions = moved.position_ids(0, moved.width)
    for b in range(moved.size):
        real = positions[b, int(moved.pad[b]) :].tolist()
        assert real == list(range(int(moved.content[b])))  # I2: 0, 1, ... over the real tokens


def test_worked_example_from_the_docstring():
    pad, content = torch.tensor([2, 0]), torch.tensor([3, 5])
    plan = plan_realign(pad, content, torch.tensor([3, 1]), torch.tensor([True, True]), torch.tensor([4, 4]))
    assert plan.width == 6
    assert plan.shift.tolist() == [-2, 0]
    assert plan.pad.tolist() == [0, 0]
    assert not plan.identity


def test_identity_when_every_row_gains_the_same():
    pad, content = torch.tensor([1, 0, 3]), torch.tensor([4, 5, 2])
    keep = torch.ones(3, dtype=torch.bool)
    plan = plan_realign(pad, content, torch.tensor([2, 2, 2]), keep, torch.full((3,), 4))
    assert plan.identity and plan.width == 7 and plan.pad.tolist() == [1, 0, 3]


def test_draft_len_is_the_least_valid_column_after_the_move():
    pad, content = torch.tensor([0, 2]), torch.tensor([6, 4])
    # row 0 gains 1 and stays, row 1 gains 3 and moves left by 2; draft valid up to columns 5 and 6
    keep = torch.ones(2, dtype=torch.bool)
    plan = plan_realign(pad, content, torch.tensor([1, 3]), keep, torch.tensor([5, 6]))
    assert plan.shift.tolist() == [0, -2]
    assert plan.draft_len == min(5 + 0, 6 - 2)


def test_check_catches_broken_invariants():
    rows = [Sequence(0, [5, 6, 7], 4), Sequence(1, [8], 4)]
    batch = BatchState.from_sequences(rows, pad_token_id=0, device=torch.device("cpu"))
    batch.target_len = batch.width - 1
    batch.check()
    batch.pad = torch.tensor([0, 1])
    with pytest.raises(AssertionError, match="I1 broken"):
        batch.check()
    batch.pad = torch.tensor([0, 2])
    batch.tokens[1, 2] = 9
    with pytest.raises(AssertionError, match="token stream out of sync"):
        batch.check()
