"""Sampling kernels: warping logits into p and q, counter-based per-row randomness, inverse-CDF draws.

The terms (p, q, accepted count ``a``, recovered token, bonus token) are defined in :mod:`batchspec.engine.verifier`,
which uses these kernels for lossless speculative sampling.

On the CPU the probabilities are the same bits on every instruction set torch dispatches to (AVX-512, AVX2, its
scalar ``default``) and every thread count: the softmax is :func:`~batchspec.engine.exactmath.exp_nonpositive` of
the shifted, tempered logits over their :func:`~batchspec.engine.exactmath.ordered_sum`, and top-k and top-p
renormalise by that sum too (torch's ``softmax`` and ``sum`` differ in their last bits between dispatches;
``tests/test_sampling.py`` computes the probabilities in processes under each dispatch and thread count and compares
their hashes). The draws read those probabilities through ``cumsum``, which adds in a fixed order as well.

Randomness is *counter-based*: the uniform a row uses for a decision is a hash of (the row's seed, the
absolute position of the token in the row's output, a :class:`Stream`). It never depends on batch size,
batch composition, the row's index in the batch or how generation is cut into rounds, so a request with a
fixed seed gets the same tokens however it is batched. Output positions count from 0: a row that has
generated ``n`` tokens draws its next token at position ``n``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from batchspec.config import SEED_LIMIT, SamplingParams, one_seed
from batchspec.engine.exactmath import exp_nonpositive, ordered_sum

_U64 = (1 << 64) - 1
# tokens of a row among which a CPU row's top-p nucleus is looked for before the whole vocabulary is sorted
NUCLEUS_CANDIDATES = 1024


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


class Stream(IntEnum):
    """Independent random streams of one row; each (position, stream) pair is used for one decision."""

    DRAFT = 0  # the draft's token at a position, drawn from q
    ACCEPT = 1  # the accept test of that draft token
    RECOVER = 2  # the recovered token, drawn from norm(max(0, p - q))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` float64 probabilities from ``[..., V]`` logits: temperature, then top-k, then top-p.

    Greedy params give the one-hot distribution at the argmax (the limit of temperature → 0); the greedy
    decoding path itself is :func:`batchspec.engine.verifier.verify_greedy`. The logits are shifted so that their
    maximum is 0 before the division: a tiny temperature (even a subnormal one) then sends the others to -inf,
    never the maximum to +inf, and the result stays a distribution (uniform over the tied maxima at worst).
    """
    rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
    settings = RowParams.of([params] * rows.shape[0], device=logits.device)
    return warp_rows(rows, settings).reshape(logits.shape)


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling settings of a batch, as tensors (rows of one round may all differ), and what the host
    knows of them, so that warping never reads the device back.

    Attributes:
        temperature: ``[B]`` float64; 0 is greedy.
        top_k: ``[B]`` int64; 0 keeps every token.
        top_p: ``[B]`` float64; 1 keeps every token.
        top_k_max: the largest ``top_k`` of any row (0: no row limits its tokens by count).
        nucleus: some row has ``top_p < 1``.
    """

    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k_max: int
    nucleus: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str | None = None) -> RowParams:
        columns = cls.columns(params)

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column(columns["temperature"], torch.float64),
            top_k=column(columns["top_k"], torch.long),
            top_p=column(columns["top_p"], torch.float64),
            **cls.flags(params),
        )

    @staticmethod
    def columns(params: Sequence[SamplingParams]) -> dict[str, list]:
        """The host lists behind the tensors: ``temperature``, ``top_k`` (0 for none), ``top_p`` (1.0 for none)."""
        return {
            "temperature": [float(p.temperature) for p in params],
            "top_k": [p.top_k or 0 for p in params],
            "top_p": [1.0 if p.top_p is None else float(p.top_p) for p in params],
        }

    @staticmethod
    def flags(params: Sequence[SamplingParams]) -> dict[str, int | bool]:
        """``top_k_max`` and ``nucleus`` of ``params``."""
        top_k = [p.top_k or 0 for p in params if not p.greedy]
        return {
            "top_k_max": max(top_k, default=0),
            "nucleus": any(p.top_p is not None and p.top_p < 1 for p in params if not p.greedy),
        }

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0

    def select(self, index: torch.Tensor) -> RowParams:
        """The settings of rows ``index`` ``[b]`` (the host flags stay those of the whole batch)."""
        return RowParams(self.temperature[index], self.top_k[index], self.top_p[index], self.top_k_max, self.nucleus)


def warp_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """``[B, ..., V]`` float64 probabilities from logits ``[B, ..., V]``, row ``i`` warped by ``params`` row ``i``:
    temperature, then top-k, then top-p; greedy rows get the one-hot distribution at their argmax. A row's result
    does not depend on the other rows: top-k and top-p (and their renormalisation) touch only the rows that ask
    for them. On the CPU a row's result is the same bits on every instruction set and thread count (the module's
    docstring)."""
    vocab = logits.shape[-1]
    shape = (-1,) + (1,) * (logits.dim() - 1)  # broadcasts a [B] setting over [B, ..., V]
    greedy = params.greedy.reshape(shape)
    temperature = torch.where(params.greedy, 1.0, params.temperature).reshape(shape)
    # one [B, ..., V] float64 tensor, worked in place (the logits' values are exact in float64, so their maximum,
    # argmax and top-k are the logits' own): <= 0, so a tiny temperature never makes +inf
    probs = logits.to(torch.float64, memory_format=torch.contiguous_format, copy=True)  # [B, ..., V]
    probs.sub_(logits.amax(dim=-1, keepdim=True).to(torch.float64)).div_(temperature)
    exp_nonpositive(probs, out=probs)  # [B, ..., V] in [0, 1], 1 at the maximum
    probs.div_(ordered_sum(probs))
    top_k = params.top_k.reshape(shape)
    if params.top_k_max > 0:
        limited = (top_k > 0) & (top_k < vocab)  # [B, 1.., 1]
        kept = _top_k_mask(logits, torch.where(limited, top_k, 1), min(params.top_k_max, vocab))  # [B, ..., V]
        _renormalise_where(probs, limited, kept)
    top_p = params.top_p.reshape(shape)
    if params.nucleus:
        _renormalise_where(probs, top_p < 1, _nucleus(probs, top_p))
    best = logits.argmax(dim=-1, keepdim=True)  # [B, ..., 1]
    at_best = torch.where(greedy, 1.0, probs.gather(-1, best))  # [B, ..., 1]
    return probs.masked_fill_(greedy, 0.0).scatter_(-1, best, at_best)  # greedy rows: one-hot at the argmax


def _renormalise_where(probs: torch.Tensor, rows: torch.Tensor, kept: torch.Tensor) -> None:
    """In ``probs`` ``[B, ..., V]``, the rows ``rows`` ``[B, 1.., 1]`` marks become ``probs * kept`` over its
    left-to-right sum (:func:`~.exactmath.ordered_sum`); the others stay as they are (times 1, over 1)."""
    probs.mul_(kept | ~rows)
    probs.div_(torch.where(rows, ordered_sum(probs), 1.0))


def _top_k_mask(scores: torch.Tensor, top_k: torch.Tensor, largest_k: int) -> torch.Tensor:
    """``[B, ..., V]`` mask of each row's ``top_k`` largest scores (ties with the k-th kept); ``top_k`` ``[B, 1..]``
    is in ``1 .. largest_k``."""
    largest = scores.topk(largest_k, dim=-1).values  # [B, ..., largest_k]
    k = top_k.clamp(max=largest_k)  # [B, 1.., 1]
    kth = largest.gather(-1, (k - 1).expand(*largest.shape[:-1], 1))  # [B, ..., 1]
    return scores >= kth


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """``[..., V]`` mask of the smallest set of most probable tokens with mass >= ``top_p`` (never empty; ties in
    the order of the token ids). On the CPU it is looked for first among each row's :data:`NUCLEUS_CANDIDATES` most
    probable tokens (:func:`_nucleus_among_largest`, the same mask), and the whole vocabulary is sorted only where
    some row's nucleus reaches past them."""
    top_p = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device)
    if probs.device.type == "cpu" and probs.shape[-1] > NUCLEUS_CANDIDATES:
        kept = _nucleus_among_largest(probs, top_p, NUCLEUS_CANDIDATES)
        if kept is not None:
            return kept
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V]
    return _kept(sorted_probs, order, top_p, probs.shape[-1])


def _kept(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., V]`` mask of the tokens ``order`` ``[..., m]`` lists (most probable first, with their probabilities
    ``sorted_probs``) whose mass before them is below ``top_p``."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., m]
    keep_sorted = mass_before < top_p  # [..., m]; the top token has mass_before 0
    mask = torch.zeros(*order.shape[:-1], vocab, dtype=torch.bool, device=order.device)  # [..., V]
    return mask.scatter_(-1, order, keep_sorted)


def _nucleus_among_largest(probs: torch.Tensor, top_p: torch.Tensor, candidates: int) -> torch.Tensor | None:
    """:func:`_nucleus`'s mask from each row's ``candidates`` most probable tokens, or None where a row that asks for
    a nucleus (``top_p < 1``) may need more.

    Sorting the vocabulary cost 0.58 s of a 0.96 s warp of ``[8, 5, 151936]`` (one thread, Zen 4), and its
    temporaries were four ``[..., V]`` tensors. Every token more probable than the candidates' least probable value
    ``v`` is a candidate, and the candidates ordered by value, ties by id, are the full stable sort's first places:
    the running sum over them adds the same numbers in the same order, so it is the same bits. Where the mass before
    the first token of value ``v`` is already at least ``top_p``, the nucleus ends before it (the running sum never
    falls), so no token outside the candidates, nor any of value ``v``, is in it, and the mask is the full sort's."""
    values, ids = probs.topk(candidates, dim=-1)  # [..., m] each, ties in any order
    by_id = ids.argsort(dim=-1)  # [..., m]
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)  # [..., m], ascending ids
    values, order = values.sort(dim=-1, descending=True, stable=True)  # [..., m]: value, then id
    ids = ids.gather(-1, order)  # [..., m]
    mass_before = values.cumsum(dim=-1) - values  # [..., m]
    first_least = (values > values[..., -1:]).sum(dim=-1, keepdim=True)  # [..., 1]: the first of value v
    ends_before = (mass_before.gather(-1, first_least) >= top_p) | (top_p >= 1)  # [..., 1]
    if not bool(ends_before.all()):
        return None
    return _kept(values, ids, top_p, probs.shape[-1])


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 step on int64 tensors (two's-complement wrap-around stands in for uint64)."""
    x = x + _GAMMA
    x = (x ^ _shift_right(x, 30)) * _MUL1
    x = (x ^ _shift_right(x, 27)) * _MUL2
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream) -> torch.Tensor:
    """``[B, m]`` float64 uniforms in ``[0, 1)`` for ``seeds`` ``[B]`` at output ``positions`` ``[B, m]``.

    Element ``(i, j)`` depends only on ``(seeds[i], positions[i, j], stream)``.
    """
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"seeds and positions must be int64, got {seeds.dtype} and {positions.dtype}")
    if positions.dim() != 2 or seeds.shape != positions.shape[:1]:
        raise ValueError(f"need seeds [B] and positions [B, m], got {list(seeds.shape)} and {list(positions.shape)}")
    if bool((positions < 0).any()):
        raise ValueError("positions must be >= 0")
    return _uniforms(seeds, positions, Stream(stream))


def _uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream) -> torch.Tensor:
    """:func:`uniforms` without the checks (which read the device): for positions the host knows are valid."""
    counters = positions * len(Stream) + int(stream)  # [B, m]
    bits = mix64(mix64(seeds)[:, None] ^ mix64(counters))  # [B, m]
    return _shift_right(bits, 11).to(torch.float64) * 2.0**-53


@dataclass(frozen=True)
class RowRandom:
    """Where a batch's random numbers come from: each row's seed and the output position of its next token.

    Attributes:
        seeds: ``[B]`` int64 per-row seeds (see :func:`derive_row_seeds`).
        offsets: ``[B]`` int64 output position of each row's next token, i.e. how many tokens it has generated.
    """

    seeds: torch.Tensor  # [B]
    offsets: torch.Tensor  # [B]

    def __post_init__(self) -> None:
        if self.seeds.dim() != 1 or self.seeds.shape != self.offsets.shape:
            shapes = f"{list(self.seeds.shape)} and {list(self.offsets.shape)}"
            raise ValueError(f"seeds and offsets must both be [B], got {shapes}")

    def positions(self, m: int) -> torch.Tensor:
        """``[B, m]`` output positions of the row's next ``m`` tokens."""
        return self.offsets[:, None] + torch.arange(m, device=self.offsets.device)

    def uniforms(self, stream: Stream, m: int) -> torch.Tensor:
        """``[B, m]`` uniforms of ``stream`` for the row's next ``m`` positions (offsets are output lengths,
        never negative, so nothing is checked on the device)."""
        return _uniforms(self.seeds, self.positions(m), stream)

    def select(self, index: torch.Tensor) -> RowRandom:
        """The seeds and offsets of rows ``index`` ``[b]``."""
        return RowRandom(self.seeds[index], self.offsets[index])


@dataclass(frozen=True)
class RoundSampling:
    """How the rows of one round sample: each row's own settings and where its random numbers come from.

    Attributes:
        params: ``[B]`` per-row settings (greedy rows have temperature 0).
        rand: the rows' seeds and output offsets.
        rows: the rows that sample (temperature > 0), as the host knows them.
        index: ``[s]`` the same rows on the device.
    """

    params: RowParams
    rand: RowRandom
    rows: tuple[int, ...]
    index: torch.Tensor  # [s]

    def __post_init__(self) -> None:
        if self.params.temperature.shape != self.rand.seeds.shape:
            raise ValueError("RoundSampling needs one setting and one seed per row")
        if self.index.shape != (len(self.rows),):
            raise ValueError("RoundSampling needs the sampling rows on the host and on the device alike")

    @property
    def sampled(self) -> torch.Tensor:  # [B] bool
        """Rows that sample (temperature > 0)."""
        return ~self.params.greedy

    @property
    def any_sampled(self) -> bool:
        return bool(self.rows)

    def greedy_rows(self, size: int) -> list[bool]:
        """Per row of the round, whether it is greedy (host)."""
        sampling = set(self.rows)
        return [i not in sampling for i in range(size)]


def derive_row_seeds(seed: int | Sequence[int] | None, n_prompts: int) -> list[int]:
    """One seed in ``[0, 2**63)`` per prompt.

    An int gives seeds derived from it and each prompt's index (so a prompt's seed does not depend on the
    other prompts); a sequence must hold one seed per prompt and is used as is; None draws fresh seeds.
    """
    if n_prompts < 0:
        raise ValueError(f"n_prompts must be >= 0, got {n_prompts}")
    if seed is None:
        return [secrets.randbits(63) for _ in range(n_prompts)]
    if isinstance(seed, int) and not isinstance(seed, bool):
        one_seed("seed", seed)
        index = torch.arange(n_prompts, dtype=torch.int64)
        return (mix64(mix64(torch.tensor(seed)) ^ index) & (SEED_LIMIT - 1)).tolist()
    if not isinstance(seed, Sequence) or isinstance(seed, str | bytes):
        raise ValueError(f"seed must be an int, a list of ints (one per prompt) or None, got {seed!r}")
    seeds = list(seed)
    if len(seeds) != n_prompts:
        raise ValueError(f"seed must hold one seed per prompt: got {len(seeds)} for {n_prompts} prompts")
    for value in seeds:
        one_seed("seed", value)
    return seeds


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[...]`` tokens drawn from ``probs`` ``[..., V]`` (non-negative with positive mass, not necessarily
    normalised) with uniforms ``u`` ``[...]`` in ``[0, 1)``.

    Token ``x`` is chosen for ``u`` in ``[cdf(x-1), cdf(x)) / total``, so a token of zero mass is never chosen.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    target = torch.minimum(u.to(torch.float64)[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [...]


def sample_draft(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B]`` draft tokens drawn from ``q`` ``[B, V]`` with the rows' ``Stream.DRAFT`` uniforms ``u`` ``[B]``."""
    if q.dim() != 2 or u.shape != q.shape[:1]:
        raise ValueError(f"need q [B, V] and u [B], got {list(q.shape)} and {list(u.shape)}")
    return inverse_cdf(q, u)
