"""Lazy realignment: lay out the rows of the next round and move their tokens and KV caches there.

After a round every row leaves its tokens and KV where that round put them (its ``KVLocation``). When a
scheduler picks the rows of the next round, :func:`plan_layout` computes their left-padded layout — width
``L = max(content)``, ``pad[i] = L - content[i]`` (I1) — and the column shift ``delta[i] = pad[i] - start[i]``
that carries row ``i``'s old columns to its new ones. One shift serves the token matrix, the target KV and the
draft KV, because all three hold a row's columns at the same offsets.

For EqSpec's batch this is the paper's unpad → append → repad: a row that gained ``n[i]`` tokens while
the batch grew from width ``L`` to ``L'`` moves by ``delta[i] = (L' - L) - n[i]``. Worked example, ``k = 2``,
``L = 5`` (``_`` is padding; ``x y`` drafts, ``z``/``w`` bonus tokens), as the round left the slab::

    row 0  start 2  [_ _ a b c x y z]   accepted both drafts: content 3 + 3 = 6
    row 1  start 0  [d e f g h w]       rejected the first draft: content 5 + 1 = 6
    L' = max(6, 6) = 6,  pad' = [0, 0],  delta = [0 - 2, 0 - 0] = [-2, 0]
    →  row 0 [a b c x y z],  row 1 [d e f g h w]

New column ``j`` of row ``i`` reads old column ``j - delta[i]``; columns that map before the row's start are
padding and only need finite values, since the attention mask hides them. A batch made of all the rows of
one slab, in order and unshifted, is in *lockstep*: the slab is reused as it is and its caches are only
cropped (dropping rejected drafts). Where the batch holds every row still in one slab (EqSpec after rows accepted
different counts, or after rows finished), its rows move within that slab's storage, which keeps its address (what
CUDA graphs replay on: :mod:`batchspec.engine.graphs`): only the rows that shift or change rows move, rows joining
(new prompts, rows of other slabs) are copied into the places of finished rows (:func:`placed` chooses the places),
and the batch runs on the storage's first rows. Anything else is copied row by row into fresh storage (a row's
columns lie together for each layer and head).

With ``slack`` (the engine's on the fused integer forward, whose bits padding cannot change) the width is chosen so
that most of the content stays where it is: where a few rows gained more than the rest, they move left into their
padding instead of every other row moving right (:func:`_width`).

Each model's cache keeps one number of columns for the whole batch (``target_len``, ``draft_len``): a forward feeds
the columns after it for every row. A row whose cache holds more loses the surplus and re-reads it; for the
target that is waste (``recomputed``), which the engine avoids by reading prompts apart (see
:mod:`batchspec.engine.prefill`), so that rows decoding together all hold every column but the pending one. The draft
may lag on purpose (it is not run in rounds that do not draft, nor on new prompts until it next drafts), so the
batch keeps the draft columns at which rows re-read at most ``draft_slack`` columns each; rows that hold fewer
keep what they have (``draft_cached``), lag, and are caught up before the draft next runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import GROWTH, BatchKVCache, Slab
from batchspec.engine.state import BatchState, HostColumns, Moved, Sequence

DRAFT_SLACK = 4
LEFT_SLACK = 32  # padding columns a gathered batch keeps on the left, for rows that gain more to move into


@dataclass(frozen=True)
class SourceRows:
    """The rows of the new batch that come from one slab (host lists of one entry per such row).

    Attributes:
        slab: where they are now.
        dest: their rows in the new batch.
        src: their rows in ``slab``.
        shift: new column minus old column (``delta``).
    """

    slab: Slab
    dest: list[int]
    src: list[int]
    shift: list[int]

    @property
    def in_order(self) -> bool:
        """All of the slab's rows, in its order."""
        return self.src == list(range(self.slab.size))

    @property
    def moving(self) -> list[int]:
        """Which of these rows shift (their places in ``dest``, ``src`` and ``shift``)."""
        return [k for k, delta in enumerate(self.shift) if delta]


@dataclass(frozen=True)
class Layout:
    """The plan for one round's batch, made on the host (lists of one entry per row).

    Attributes:
        pad, content: new padding and content lengths (I1: ``pad + content == width``).
        width: the new padded width ``L``.
        target_len, draft_len: cache columns the batch keeps (``<= L - 1``); the models re-read the columns after.
        draft_cached: draft columns valid from each row's first real token in the new layout.
        lagging: rows whose draft holds fewer columns than the batch keeps (see :func:`_draft_length`).
        recomputed: target columns that rows already held and will read again (``target_len`` cuts them off).
        sources: the rows that come from existing slabs, one entry per slab.
        fresh: rows without any KV yet (new prompts), filled from their token lists.
        reuse: the slab to run on as it is (lockstep), or None when tokens and caches are gathered.
    """

    pad: list[int]
    content: list[int]
    width: int
    target_len: int
    draft_len: int
    draft_cached: list[int]
    lagging: tuple[int, ...]
    recomputed: int
    sources: tuple[SourceRows, ...]
    fresh: tuple[int, ...]
    reuse: Slab | None

    @property
    def padded(self) -> bool:
        """Rows of different lengths share the batch: an unpad–append–repad realignment."""
        return any(self.pad)


def placed(rows: list[Sequence]) -> list[Sequence]:
    """``rows`` in the order that moves the fewest of them: the rows of the slab most of them are in keep their rows of
    it where the batch has that many (laid out in lockstep or within that slab's storage: :func:`assemble`), and the
    others (rows of that slab past the batch's size, rows of other slabs, new rows) take the places left, in the
    order given. Rows decode alike at any place in a batch, so only what a layout copies depends on it.

    Example: rows ``a, b, d`` of one slab (its rows 0, 1 and 3; row 2 finished) and a new row ``e`` in that order:
    ``a, b, e, d``, so ``e`` joins in row 2's place and no row moves. Without ``e``: ``a, b, d``, and ``d`` moves into
    row 2 (rows past the batch's size move into the places left)."""
    homes = Counter(id(row.kv.slab) for row in rows if row.kv is not None and not row.kv.slab.shared)
    if not homes:
        return rows
    home = homes.most_common(1)[0][0]
    places: list[Sequence | None] = [None] * len(rows)
    rest = []
    for row in rows:
        if row.kv is not None and id(row.kv.slab) == home and row.kv.row < len(rows):
            places[row.kv.row] = row
        else:
            rest.append(row)
    others = iter(rest)
    return [row if row is not None else next(others) for row in places]


def plan_layout(rows: list[Sequence], *, draft_slack: int | None = DRAFT_SLACK, slack: int = 0) -> Layout:
    """Where each of ``rows`` goes in the next batch, and how many cached columns each model keeps.

    ``draft_slack`` None keeps only the draft columns every row holds (for a batch that is to catch up). ``slack``
    (see :func:`_width`) lets the width exceed the longest row, so that rows which gained more than the others move
    left into their padding rather than all the others right.
    """
    content = [row.content_len for row in rows]
    width = _width(rows, content, slack)
    pad = [width - c for c in content]
    target = [row.kv.target_cached if row.kv else 0 for row in rows]
    draft = _draft_held(rows)
    target_len = min(p + t for p, t in zip(pad, target, strict=True))
    recomputed = _reread(pad, target, target_len)
    draft_len = _draft_length(pad, draft, draft_slack)
    sources, fresh = _sources(rows, pad)
    lockstep = (len(sources) == 1 and not fresh and sources[0].in_order and not any(sources[0].shift)
                and not sources[0].slab.shared)
    return Layout(
        pad=pad,
        content=content,
        width=width,
        target_len=target_len,
        draft_len=draft_len,
        draft_cached=_kept(pad, draft, draft_len),
        lagging=_lagging(pad, draft, draft_len),
        recomputed=recomputed,
        sources=sources,
        fresh=fresh,
        reuse=sources[0].slab if lockstep else None,
    )


def _width(rows: list[Sequence], content: list[int], slack: int) -> int:
    """The batch's width: the longest row's content without ``slack``. With it, for all of one slab's rows in order
    (EqSpec's next round), the column after which most of their content already ends (no row's padding below 0), so
    that only the rows ending elsewhere move; where that would still move most of the content, every row moves, and
    the width becomes the longest content plus ``slack``, padding every row by at least ``slack`` for the rounds after.
    A gathered batch is laid out with that slack too; one with a row without KV (a new prompt) is not.

    Example, slack 4, rows of content ``[10, 8, 8]`` ending at columns ``[13, 12, 12]`` of their slab (row 0 gained one
    token more): width 12 keeps rows 1 and 2 where they are (start 4) and moves row 0 one column left, into its
    padding (start 3 → 2). Had rows 1 and 2 been one row of content 8, width 13 would move it one column right."""
    tight = max(content, default=0)
    if not slack or any(row.kv is None for row in rows):  # a row without KV holds no padding columns to keep
        return tight
    ends = _ends(rows)
    if ends is None:
        return tight + slack
    held: dict[int, int] = {}
    for end, length in zip(ends, content, strict=True):
        if end >= tight:
            held[end] = held.get(end, 0) + length
    best = max(held, key=lambda end: (held[end], -end))  # the longest row's end is always a candidate
    return best if 2 * held[best] >= sum(content) else tight + slack


def _ends(rows: list[Sequence]) -> list[int] | None:
    """Where each row's content ends in its slab (one past its last column), where all of ``rows`` are one slab's
    rows in its order; else None."""
    slabs = {id(row.kv.slab) for row in rows}
    if len(slabs) != 1 or any(row.kv.row != i or row.kv.slab.shared for i, row in enumerate(rows)):
        return None
    if rows[0].kv.slab.size != len(rows):
        return None
    return [row.kv.start + row.content_len for row in rows]


def _draft_length(pad: list[int], draft: list[int], slack: int | None) -> int:
    """Draft columns the batch keeps: the fewest any row holds (``slack`` None), or else the smallest length at
    which rows re-read at most ``slack`` columns each on average; rows that hold fewer lag and are caught up apart
    before the draft runs. Never more than some row holds.

    Example: rows of 10 tokens (no padding) holding ``[9, 9, 2]`` draft columns, slack 4: keeping 2 columns would
    make the first two rows re-read 14 columns (more than 3 * 4), keeping 9 makes nobody re-read anything; so the
    batch keeps 9 and the third row, holding 2 of them, lags. Rows holding none never re-read: a new batch keeps 0.
    """
    ends = sorted({p + d for p, d in zip(pad, draft, strict=True)})
    held = max((p + d for p, d in zip(pad, draft, strict=True) if d), default=0)
    if slack is None:
        return min(ends[0], held)

    budget = slack * len(pad)
    return min(next(length for length in ends if _reread(pad, draft, length) <= budget), held)


def draft_catch_up(rows: list[Sequence], *, draft_slack: int = DRAFT_SLACK, far: int | None = None) -> tuple[int, ...]:
    """The rows whose draft must read what it lacks before the draft runs, so that none of ``rows`` lags then.

    A row that catches up holds every column but its pending one, which can raise the columns the batch keeps
    (:func:`_draft_length`) past what another row holds: that row lags in turn. So rows are added until the layout
    of the caught-up rows has no lagging row. With ``far``, a row whose draft lacks more than ``far`` columns before
    its pending token catches up too, though it does not lag: the draft's first forward reads what the rows lack
    for all of them at once, so rows that all lack much (the draft was idle, or never read their prompts: the batch
    then keeps no draft column and no row lags) would make it read their whole lag in one round.

    Example, slack 1, rows of content ``[10, 10, 4]`` (pad ``[0, 0, 6]``) holding ``[9, 3, 0]`` draft columns: the
    batch keeps 6 columns (keeping 3 would make row 0 re-read 6 of them), so row 1 lags. Caught up, it holds 9;
    now keeping 6 would make rows 0 and 1 re-read 3 each, so the batch keeps 9, and row 2 (its columns start at
    6, it holds none) lags too: the answer is ``(1, 2)``.
    """
    content, pad = _padding(rows)
    held = _draft_held(rows)
    lacking = [c - 1 - h for c, h in zip(content, held, strict=True)]
    chosen = set() if far is None else {i for i, lack in enumerate(lacking) if lack > far}
    for i in chosen:
        held[i] = content[i] - 1
    while lagging := _lagging(pad, held, _draft_length(pad, held, draft_slack)):
        for i in lagging:
            held[i] = content[i] - 1
        chosen.update(lagging)
    return tuple(sorted(chosen))


def _padding(rows: list[Sequence]) -> tuple[list[int], list[int]]:
    """Each row's content length and its left padding in a batch as wide as the longest."""
    content = [row.content_len for row in rows]
    width = max(content, default=0)
    return content, [width - c for c in content]


def _draft_held(rows: list[Sequence]) -> list[int]:
    """The draft columns each row holds from its first real one (none without KV)."""
    return [row.kv.draft_cached if row.kv else 0 for row in rows]


def _kept(pad: list[int], held: list[int], length: int) -> list[int]:
    """Columns each row keeps of a cache cut to ``length``: those it holds (``held[i]`` from its first real one,
    at column ``pad[i]``) that lie before ``length``."""
    return [max(0, min(h, length - p)) for p, h in zip(pad, held, strict=True)]


def _lagging(pad: list[int], held: list[int], length: int) -> tuple[int, ...]:
    """Rows whose draft columns end before the ``length`` the batch keeps."""
    return tuple(i for i, (p, k) in enumerate(zip(pad, _kept(pad, held, length), strict=True)) if p + k < length)


def _reread(pad: list[int], held: list[int], length: int) -> int:
    """Columns rows hold (``held[i]`` from their first real one) that a cache kept to ``length`` makes them read
    again; padding columns hold nothing, so a row without KV re-reads nothing."""
    return sum(max(0, min(h, p + h - length)) for p, h in zip(pad, held, strict=True))


def _sources(rows: list[Sequence], pad: list[int]) -> tuple[tuple[SourceRows, ...], tuple[int, ...]]:
    """The rows grouped by the slab they are in, with their shifts; and the rows without KV."""
    grouped: dict[int, tuple[Slab, list[int], list[int], list[int]]] = {}
    fresh = []
    for i, row in enumerate(rows):
        if row.kv is None:
            fresh.append(i)
            continue
        slab, dest, src, shift = grouped.setdefault(id(row.kv.slab), (row.kv.slab, [], [], []))
        dest.append(i)
        src.append(row.kv.row)
        shift.append(pad[i] - row.kv.start)
    sources = tuple(SourceRows(s, d, r, sh) for s, d, r, sh in grouped.values())
    return sources, tuple(fresh)


@dataclass(frozen=True)
class _Staged:
    """The device copies of one source's ``dest``, ``src`` and ``shift`` (``[b]`` each)."""

    source: SourceRows
    dest: torch.Tensor  # [b]
    src: torch.Tensor  # [b]
    shift: torch.Tensor  # [b]


def layout_columns(layout: Layout, rows: list[Sequence], layers: tuple[int, int | None]) -> tuple:
    """The host columns :func:`assemble` needs on the device: pad, content and draft columns per row, each source
    slab's rows and shifts, and the tokens of the rows without KV."""
    host = _host_columns(layout, layers)
    per_source = [column for source in layout.sources for column in (source.dest, source.src, source.shift)]
    fresh = [rows[i].content for i in layout.fresh]
    return (host.pad, host.content, host.draft_cached, *per_source, *fresh)


def _host_columns(layout: Layout, layers: tuple[int, int | None]) -> HostColumns:
    """The batch's pad, content and draft columns per row (no draft columns without a draft cache)."""
    with_draft = layers[1] is not None and (layout.reuse is None or layout.reuse.draft is not None)
    draft_cached = layout.draft_cached if with_draft else [0] * len(layout.pad)
    return HostColumns(pad=layout.pad, content=layout.content, draft_cached=draft_cached)


def assemble(
    layout: Layout,
    rows: list[Sequence],
    staged: tuple[torch.Tensor, ...],
    *,
    filler: int,
    layers: tuple[int, int | None],
) -> BatchState:
    """Build the batch of ``layout``: reuse a lockstep slab, or gather tokens and both caches into a new one.
    ``staged`` holds :func:`layout_columns` on the device.

    ``layers`` is the number of decoder layers of the target and of the draft (None without a draft).
    """
    host = _host_columns(layout, layers)
    pad, content, cached, *staged = staged
    if layout.reuse is not None:
        slab = layout.reuse
        slab.target.crop(layout.target_len)
        if slab.draft is not None:
            slab.draft.crop(layout.draft_len)
        slab = Slab(slab.tokens[:, : layout.width], slab.target, slab.draft, holders=tuple(rows))
        return BatchState(rows, pad, content, slab, cached, host)
    sources = [_Staged(source, *staged[3 * j : 3 * j + 3]) for j, source in enumerate(layout.sources)]
    fresh_tokens = staged[3 * len(sources) :]
    target_layers, draft_layers = layers
    draft, draft_moved = None, Moved(0, 0)
    if draft_layers is not None:
        draft, draft_moved = _move_cache(layout, sources, lambda s: s.draft, draft_layers, layout.draft_len)
    target, moved = _move_cache(layout, sources, lambda s: s.target, target_layers, layout.target_len)
    tokens = _gather_tokens(layout, sources, fresh_tokens, pad, filler)
    slab = Slab(tokens=tokens, target=target, draft=draft, holders=tuple(rows))
    return BatchState(rows, pad, content, slab, cached, host, Moved(moved.bytes + draft_moved.bytes, moved.rows))


def _gather_tokens(
    layout: Layout, sources: list[_Staged], fresh: list[torch.Tensor], pad: torch.Tensor, filler: int
) -> torch.Tensor:
    """``[B, L]`` token matrix of the new layout; ``fresh`` holds the tokens of each row without KV."""
    size, width = len(layout.pad), layout.width
    tokens = torch.full((size, width), filler, dtype=torch.long, device=pad.device)
    cols = torch.arange(width, device=pad.device)
    for staged in sources:
        old = staged.source.slab.tokens.index_select(0, staged.src)  # [b, C]
        index = (cols[None, :] - staged.shift[:, None]).clamp(0, old.shape[1] - 1)  # [b, L]
        tokens[staged.dest] = old.gather(1, index)
    for i, row in zip(layout.fresh, fresh, strict=True):
        tokens[i, layout.pad[i] :] = row
    return tokens.masked_fill(cols[None, :] < pad[:, None], filler)


def _move_cache(layout: Layout, sources: list[_Staged], pick, num_layers: int,
                length: int) -> tuple[BatchKVCache, Moved]:
    """The cache of the new layout (``pick`` chooses the target's or the draft's) and what making it copied: moved
    within the storage of the slab most of its rows come from (:func:`_host`), the rest copied into its free rows;
    else gathered into fresh storage."""
    size = len(layout.pad)
    host = _host(sources, pick, length, size)
    if host is None:
        return _gather_cache(layout, sources, pick, num_layers, length)
    cache = pick(host.slab)
    if cache.length <= 0:
        raise InvariantError("a shifted cache holds columns")
    storage = cache.storage if cache.storage.shape[2] == size else cache.whole[:, :, :size]  # [N, 2, B, H, C, D]
    moved = _copy_rows(cache, host, storage, layout.pad, length)
    for staged in sources:
        joined = pick(staged.source.slab)
        if staged.source is not host and joined is not None and joined.storage is not None:
            moved = moved + _copy_rows(joined, staged.source, storage, layout.pad, length)
    return BatchKVCache(num_layers, storage, length, whole=cache.whole), moved


def _host(sources: list[_Staged], pick, length: int, size: int) -> SourceRows | None:
    """The source whose storage the batch of ``size`` rows runs in, without allocating: the one of most rows whose
    slab's rows still in use are all in the batch (:func:`_only_holders`), whose storage holds ``size`` rows and
    ``length`` columns, and whose rows can move within it in their order (:func:`_in_place`); None: a gather."""
    fits = [staged.source for staged in sources
            if (cache := pick(staged.source.slab)) is not None and cache.storage is not None
            and 0 < length <= cache.whole.shape[4] and size <= cache.whole.shape[2]
            and _only_holders(staged.source) and _in_place(staged.source)]
    return max(fits, key=lambda source: len(source.src), default=None)


def _in_place(source: SourceRows) -> bool:
    """Whether copying ``source``'s rows one by one, in order, into their new rows of the same storage reads every
    row before any copy overwrites it: no row goes where a row not yet copied still is. Rows that stay, rows moving
    up into the places of finished rows and rows moving into free rows pass; a swap does not.

    Example: ``src = [0, 2, 3]`` to ``dest = [0, 1, 2]`` passes (row 2 is copied into row 1 before row 3 into row 2);
    so does ``src = [0, 3, 2]`` to ``dest = [0, 1, 2]`` (row 3 into the finished row 1's place, row 2 stays); ``src =
    [1, 0]`` to ``dest = [0, 1]`` does not (row 0 would be overwritten before it is read)."""
    pending = set(source.src)
    for dest, src in zip(source.dest, source.src, strict=True):
        pending.discard(src)
        if dest != src and dest in pending:
            return False
    return True


def _only_holders(source: SourceRows) -> bool:
    """The rows moved are every row that still keeps its KV in their slab (no row outside the batch still needs its
    place there), and the slab is not the prefix cache's."""
    slab = source.slab
    kept = sum(1 for row in slab.holders if row.kv is not None and row.kv.slab is slab)
    return not slab.shared and kept == len(source.src)


def _copy_rows(cache: BatchKVCache, source: SourceRows, storage: torch.Tensor, pad: list[int],
               length: int) -> Moved:
    """``source``'s rows of ``cache`` into their rows of ``storage`` (possibly ``cache``'s own, rows in an order
    :func:`_in_place` allows) at their new columns; a row of the same storage that neither shifts nor changes rows
    stays where it is. Returns what was copied."""
    own = storage.data_ptr() == cache.storage.data_ptr()
    copied = moved = 0
    for dest, src, shift in zip(source.dest, source.src, source.shift, strict=True):
        if shift or src != dest or not own:
            copied += _copy_row(cache, src, storage, dest, pad[dest], shift, length)
            moved += 1
    return Moved(copied, moved)


def _copy_row(cache: BatchKVCache, src: int, storage: torch.Tensor, dest: int, pad: int, shift: int,
              length: int) -> int:
    """Row ``src``'s columns of ``cache`` into row ``dest`` of ``storage`` (``[N, 2, B, H, capacity, D]``, possibly
    ``cache``'s own), shifted by ``shift``: new columns ``pad .. length - 1`` from old columns ``pad - shift ..``, as
    many as the old cache holds. A row's columns lie together for each layer and head, so this is one copy at the
    memory's speed (2 rows of 600 columns of the 1.5B target: 4.3 ms, where a gather over an expanded index took 50).
    Returns the bytes copied."""
    old = pad - shift
    count = min(length - pad, cache.length - old)
    if count <= 0:
        return 0
    part = cache.storage[:, :, src, :, old : old + count]  # [N, 2, H, count, D]
    if src == dest and storage.data_ptr() == cache.storage.data_ptr():
        _shift_within(part, storage[:, :, dest, :, pad : pad + count])
    else:
        storage[:, :, dest, :, pad : pad + count] = part
    return part.numel() * part.element_size()


def _shift_within(part: torch.Tensor, into: torch.Tensor) -> None:
    """Copy ``part`` to ``into`` (``[N, 2, H, count, D]`` each), the same row's columns of one storage, which overlap:
    through a copy of one layer at a time. A copy of the whole row at once would allocate it afresh at every move, and
    the fresh pages cost more than the copy: 12.6 ms against 2.0 for a row of 1,200 columns of the 1.5B target
    (34 MB) on a Zen 4; a layer's part is small enough that the allocator hands the same memory back."""
    for layer in range(part.shape[0]):
        into[layer] = part[layer].clone()  # [2, H, count, D]


def _gather_cache(layout: Layout, sources: list[_Staged], pick, num_layers: int,
                  length: int) -> tuple[BatchKVCache, Moved]:
    """A cache holding ``length`` columns of the new layout, copied row by row from each source slab's cache, and
    what that copied."""
    stores = [(staged.source, pick(staged.source.slab)) for staged in sources]
    stores = [(source, cache) for source, cache in stores if cache is not None and cache.storage is not None]
    if length == 0 or not stores:
        return BatchKVCache(num_layers), Moved(0, 0)
    n, two, _, heads, _, dim = stores[0][1].storage.shape
    storage = stores[0][1].storage.new_zeros((n, two, len(layout.pad), heads, length + GROWTH, dim))
    moved = Moved(0, 0)
    for source, cache in stores:
        moved = moved + _copy_rows(cache, source, storage, layout.pad, length)
    return BatchKVCache(num_layers, storage, length), moved


def compact(rows: list[Sequence]) -> int:
    """Move ``rows`` out of storage that mostly holds rows no longer in use; returns the slabs compacted.

    A slab is allocated for a whole batch, and rows that do not run stay in the slab of the batch they last ran
    in. Under ExSpec a window of ``W`` rows may thus pin up to ``W`` slabs of ``B`` rows each, far more KV than the
    rows need. Every slab in which at most half of the rows are among ``rows`` is replaced by a slab of just
    those rows (same columns and starts; only their slab row changes), so memory stays within twice the live
    rows. Example: rows 1 and 6 of an 8-row slab are live → a 2-row slab holding them as rows 0 and 1.
    """
    live: dict[int, tuple[Slab, list[Sequence]]] = {}
    for row in rows:
        if row.kv is not None:
            live.setdefault(id(row.kv.slab), (row.kv.slab, []))[1].append(row)
    compacted = 0
    for slab, members in live.values():
        if 2 * len(members) > slab.size:
            continue
        members.sort(key=lambda r: r.kv.row)
        src = torch.tensor([r.kv.row for r in members], dtype=torch.long, device=slab.tokens.device)  # [b]
        draft = None if slab.draft is None else _select_rows(slab.draft, src)
        small = Slab(slab.tokens.index_select(0, src), _select_rows(slab.target, src), draft, holders=tuple(members))
        for i, row in enumerate(members):
            row.kv = replace(row.kv, slab=small, row=i)
        compacted += 1
    return compacted


def _select_rows(cache: BatchKVCache, src: torch.Tensor) -> BatchKVCache:
    """A copy of rows ``src`` of ``cache``, with its columns and a fresh growth margin."""
    if cache.storage is None:
        return BatchKVCache(len(cache.layers))
    kept = cache.storage[:, :, :, :, : cache.length + GROWTH]  # [N, 2, B, H, length + GROWTH, D]
    return BatchKVCache(len(cache.layers), kept.index_select(2, src), cache.length)
