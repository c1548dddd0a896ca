"""Sampling kernels and lossless speculative sampling, checked statistically on hand-built p and q; the exp, log and
fixed-order sums under the probabilities and logprobs, against mpmath and across torch's CPU dispatches and thread
counts."""

from __future__ import annotations

import functools
import json
import math
import operator
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import dispatch_digests
import mpmath
import pytest
import torch
from scipy import stats

import batchspec.engine.exactmath as exactmath
import batchspec.engine.sampling as sampling
import batchspec.engine.verifier as verifier
from batchspec.engine.exactmath import exp_nonpositive, exp_sum, log, ordered_sum
from batchspec.engine.logprobs import scored
from batchspec.engine.sampling import (
    RoundSampling,
    RowParams,
    RowRandom,
    SamplingParams,
    Stream,
    derive_row_seeds,
    inverse_cdf,
    mix64,
    sample_draft,
    uniforms,
    warp,
    warp_rows,
)
from batchspec.engine.verifier import Verdict, verify_greedy, verify_sampling

ROWS = 20_000
PASS_P = 1e-3
FAIL_P = 1e-6
U64 = (1 << 64) - 1


def dist(*values: float) -> torch.Tensor:
    """``[V]`` float64 distribution from (approximately normalised) values."""
    probs = torch.tensor(values, dtype=torch.float64)
    return probs / probs.sum()


GENERIC_P = dist(0.35, 0.25, 0.2, 0.1, 0.1, 0.0)
GENERIC_Q = dist(0.1, 0.1, 0.2, 0.3, 0.2, 0.1)
# per case: p and q [k+1, V] for k = 2, one row of distributions per position
CASES = {
    "generic": (
        torch.stack([GENERIC_P, GENERIC_P.roll(2), GENERIC_Q]),
        torch.stack([GENERIC_Q, GENERIC_Q.roll(1), GENERIC_P]),
    ),
    "q_equals_p": (torch.stack([GENERIC_P, GENERIC_Q, GENERIC_P]),) * 2,
    "disjoint": (
        torch.stack([dist(0.5, 0.3, 0.2, 0, 0, 0)] * 3),
        torch.stack([dist(0, 0, 0, 0.6, 0.3, 0.1)] * 3),
    ),
    "tiny_q_where_p_large": (
        torch.stack([dist(0.6, 0.2, 0.1, 0.1, 0, 0)] * 3),
        torch.stack([dist(1e-12, 0.4, 0.3, 0.2, 0.1, 0)] * 3),
    ),
    "bonus_after_all_accepted": (
        torch.stack([GENERIC_Q, GENERIC_P, GENERIC_P]),
        torch.stack([GENERIC_Q, GENERIC_P, GENERIC_Q]),
    ),
}


def batch_random(seed: int, rows: int = ROWS) -> RowRandom:
    """Distinct per-row seeds and scattered output positions."""
    offsets = torch.randint(0, 10_000, (rows,), generator=torch.Generator().manual_seed(seed))
    return RowRandom(seeds=torch.tensor(derive_row_seeds(seed, rows)), offsets=offsets)


@dataclass(frozen=True)
class Round:
    p: torch.Tensor  # [B, k+1, V]
    q: torch.Tensor  # [B, k+1, V]
    drafts: torch.Tensor  # [B, k+1]
    verdict: Verdict


def run_round(p_steps: torch.Tensor, q_steps: torch.Tensor, rand: RowRandom) -> Round:
    """Draft ``d_1 .. d_{k+1}`` from ``q_steps`` ``[k+1, V]`` as the proposer would, then verify against p."""
    rows, steps = rand.seeds.shape[0], p_steps.shape[0]
    p = p_steps.expand(rows, -1, -1)  # [B, k+1, V]
    q = q_steps.expand(rows, -1, -1)  # [B, k+1, V]
    drafts = inverse_cdf(q, rand.uniforms(Stream.DRAFT, steps))  # [B, k+1]
    return Round(p=p, q=q, drafts=drafts, verdict=verify_sampling(drafts, q, p, rand))


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``tokens`` ``[n]`` being drawn from ``probs`` ``[V]``; 0 when a token falls outside its support."""
    counts = torch.bincount(tokens, minlength=probs.shape[0])
    support = probs > 0
    if counts.shape != probs.shape or int(counts[~support].sum()) > 0:
        return 0.0
    expected = probs[support] / probs[support].sum() * tokens.shape[0]
    return float(stats.chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


def emitted_at(verdict: Verdict, j: int) -> torch.Tensor:
    """Tokens emitted at round position ``j`` (from 1) by the rows that reach it."""
    return verdict.tokens[verdict.gained >= j, j - 1]


def position_pvalues(case: str, seed: int) -> list[tuple[int, float]]:
    """(rows reaching position j, chi-square p-value against p_j) for j = 1 .. k+1."""
    p_steps, q_steps = CASES[case]
    verdict = run_round(p_steps, q_steps, batch_random(seed)).verdict
    tokens = [emitted_at(verdict, j) for j in range(1, p_steps.shape[0] + 1)]
    return [(t.shape[0], chi2_pvalue(t, p_steps[j]) if t.shape[0] else math.nan) for j, t in enumerate(tokens)]


# ---- SamplingParams and warp -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
        ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
        ({"temperature": 1.0, "top_p": True}, "top_p"),
    ],
)
def test_params_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_params_greedy_flag():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9).greedy


def random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_warp_is_normalised_float64_and_keeps_shape():
    logits = random_logits(2, 3, 50).float()
    for params in [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=7, top_p=0.6)]:
        probs = warp(logits, params)
        assert probs.dtype == torch.float64 and probs.shape == logits.shape
        assert torch.allclose(probs.sum(dim=-1), torch.ones(2, 3, dtype=torch.float64), atol=1e-12)
        assert bool((probs >= 0).all())


def test_warp_temperature_matches_softmax():
    logits = random_logits(4, 50)
    for temperature in [0.3, 1.0, 2.5]:
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        assert torch.allclose(warp(logits, SamplingParams(temperature=temperature)), expected, atol=1e-12)


def one_hot_at_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).double()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-9),
        SamplingParams(),
        SamplingParams(temperature=5e-324),
        SamplingParams(temperature=1e-300, top_p=5e-324),
    ],
    ids=["top_k_1", "tiny_top_p", "greedy", "subnormal_temperature", "tiny_temperature_and_top_p"],
)
def test_warp_collapses_to_the_argmax(params):
    logits = random_logits(5, 50)
    assert torch.equal(warp(logits, params), one_hot_at_argmax(logits))


def test_top_k_keeps_the_k_largest_in_proportion():
    logits = random_logits(3, 50)
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=4))
    full = torch.softmax(logits.double(), dim=-1)
    top = full.topk(4, dim=-1).indices
    assert bool(((probs > 0).sum(dim=-1) == 4).all())
    assert torch.allclose(probs.gather(-1, top), full.gather(-1, top) / full.gather(-1, top).sum(-1, keepdim=True))


def test_top_p_keeps_the_smallest_nucleus_after_top_k():
    logits = dist(0.5, 0.3, 0.15, 0.05).log()
    kept = {
        SamplingParams(temperature=1.0, top_p=0.79): [0.625, 0.375, 0, 0],
        SamplingParams(temperature=1.0, top_p=0.81): [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        SamplingParams(temperature=1.0, top_p=1.0): [0.5, 0.3, 0.15, 0.05],
        # top-k first: {0, 1} renormalised to [0.625, 0.375], then the nucleus of mass 0.6 is token 0 alone
        SamplingParams(temperature=1.0, top_k=2, top_p=0.6): [1, 0, 0, 0],
    }
    for params, expected in kept.items():
        assert torch.allclose(warp(logits, params), torch.tensor(expected, dtype=torch.float64)), params


def test_top_p_stops_as_soon_as_the_mass_is_reached():
    logits = dist(0.5, 0.25, 0.125, 0.125).log()  # softmax gives 0.5 and 0.25 exactly
    assert warp(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [1, 0, 0, 0]
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.75)), dist(2, 1, 0, 0))


def test_the_nucleus_among_the_largest_tokens_is_the_full_sorts(monkeypatch):
    """The CPU's nucleus looked for among a row's most probable tokens is the mask the whole vocabulary's stable sort
    gives, bit for bit: for peaked and flat rows, ties at the candidates' edge and inside the nucleus, top-p from
    0.05 to 1; a row whose nucleus reaches past the candidates falls back to the sort."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 3, 5000, generator=generator) * torch.tensor([0.5, 2, 4, 8, 8, 8])[:, None, None]
    logits[3, :, :40] = 3.0  # ties inside the nucleus
    logits[4, :, 50:2000] = logits[4, :, 49:50]  # ties across the candidates' edge
    logits[5] = 0.0  # flat: the nucleus reaches past the candidates
    top_p = torch.tensor([0.05, 0.3, 0.6, 0.9, 0.95, 1.0])
    params = RowParams.of([SamplingParams(temperature=0.9, top_p=float(p)) for p in top_p])
    candidates = warp_rows(logits, params)  # [6, 3, 5000]
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 10**9)  # the whole vocabulary sorted
    assert torch.equal(candidates, warp_rows(logits, params))
    flat = torch.zeros(1, 1, 5000)
    probs = warp_rows(flat, RowParams.of([SamplingParams(temperature=1.0)]))  # [1, 1, 5000], uniform
    assert sampling._nucleus_among_largest(probs, torch.tensor(0.5), 1024) is None
    kept = sampling._nucleus(probs, torch.tensor(0.5))[0, 0]  # [5000]: ties in the order of the ids
    count = int(kept.sum())
    assert abs(count - 2500) <= 2 and kept[:count].all() and not kept[count:].any()


# ---- exp, log and sums with the same bits on every CPU (batchspec.engine.exactmath) -----------------------------

# torch's dispatch in this process; ATEN_CPU_CAPABILITY may only lower it, never claim what the CPU lacks
CAPABILITY = torch.backends.cpu.get_cpu_capability()
AVX2 = pytest.mark.skipif(CAPABILITY not in ("AVX2", "AVX512"), reason=f"torch dispatches to {CAPABILITY}, below AVX2")
DISPATCHES = [pytest.param("default"), pytest.param("avx2", marks=AVX2)]


# exp's: zeros, the smallest steps, the last normal result (-708.396...), the last nonzero result (-745.133...1) and
# the first zero (-745.133...2), and far below
EXP_EDGES = (0.0, -0.0, -5e-324, -(2.0**-30), -math.log(2), -1.0, -708.3964185322641, -709.0, -745.0)
EXP_EDGES += (-745.1332191019411, -745.1332191019412, -745.2, -746.0, -1e300)
# log's: the smallest subnormal and normal, around 1 and sqrt(2) (where fdlibm halves m), a vocabulary, the largest
LOG_EDGES = (5e-324, 1e-310, 2.0**-1022, 0.5, 1.0, 1.0 + 2.0**-52, 1.0 - 2.0**-53, 2.0, math.sqrt(2.0), 151936.0)
LOG_EDGES += (1.7976931348623157e308,)


def ordered_bits(values: torch.Tensor) -> torch.Tensor:
    """float64 ``values`` as int64 in the order of the floats, so that neighbouring floats differ by 1."""
    bits = values.view(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFFFFFFFFFF), bits)


def correctly_rounded(value: mpmath.mpf) -> float:
    """``value`` (120 bits) rounded once to float64, subnormal results to the grid of 2**-1074."""
    if abs(value) < mpmath.mpf(2) ** -1022:
        return float(mpmath.nint(value * mpmath.mpf(2) ** 1074)) * 2.0**-1074
    return float(value)


def ulp_errors(got: torch.Tensor, function, arguments: list[float]) -> torch.Tensor:
    """``[n]`` how many floats ``got`` lies from ``function`` (mpmath's) of ``arguments``, correctly rounded."""
    with mpmath.workprec(120):
        want = torch.tensor([correctly_rounded(function(mpmath.mpf(x))) for x in arguments], dtype=torch.float64)
    return (ordered_bits(got) - ordered_bits(want)).abs()


def test_exp_and_log_are_within_one_ulp_of_the_correctly_rounded_values():
    """fdlibm's bound, measured: at most 1 ulp from mpmath's value rounded once (about 92% of exp's and 97% of log's
    results are the correctly rounded ones), over 12,000 seeded arguments each and the edges: exp from 0 down past its
    underflow (results in the subnormal range included), log over every binade (subnormal arguments included), near
    1 (fdlibm's series branch) and over the sampler's totals (1 to a vocabulary's size)."""
    draw = random.Random(63)
    exp_arguments = (
        [draw.uniform(-745.2, 0.0) for _ in range(4000)]
        + [draw.uniform(-1.0, 0.0) for _ in range(3000)]
        + [-draw.expovariate(0.1) for _ in range(3000)]
        + [draw.uniform(-745.2, -700.0) for _ in range(2000)]
        + list(EXP_EDGES)
    )
    errors = ulp_errors(exp_nonpositive(torch.tensor(exp_arguments, dtype=torch.float64)), mpmath.exp, exp_arguments)
    assert int(errors.max()) <= 1
    log_arguments = (
        [struct_float(draw.randrange(1, 0x7FF0000000000000)) for _ in range(4000)]
        + [draw.uniform(0.5, 2.0) for _ in range(3000)]
        + [1.0 + draw.uniform(-(2.0**-20), 2.0**-20) for _ in range(2000)]
        + [draw.uniform(1.0, 151936.0) for _ in range(3000)]
        + list(LOG_EDGES)
    )
    errors = ulp_errors(log(torch.tensor(log_arguments, dtype=torch.float64)), mpmath.log, log_arguments)
    assert int(errors.max()) <= 1


def struct_float(bits: int) -> float:
    """The float64 whose bit pattern is the int64 ``bits``."""
    return torch.tensor([bits], dtype=torch.int64).view(torch.float64).item()


def test_exp_and_log_give_the_limits_at_their_edges_and_refuse_other_dtypes():
    edges = [0.0, -0.0, -math.inf, math.nan, -746.0, -745.1332191019411, 3.0]
    got = exp_nonpositive(torch.tensor(edges, dtype=torch.float64))
    assert got[:3].tolist() == [1.0, 1.0, 0.0] and math.isnan(got[3]) and got[4:].tolist() == [0.0, 5e-324, 1.0]
    got = log(torch.tensor([1.0, 0.0, -0.0, math.inf, -1.0, -math.inf, math.nan, 5e-324], dtype=torch.float64))
    assert got[:4].tolist() == [0.0, -math.inf, -math.inf, math.inf] and all(math.isnan(v) for v in got[4:7])
    assert got[7].item() == -744.4400719213812
    with pytest.raises(TypeError, match="float64"):
        exp_nonpositive(torch.zeros(3))
    with pytest.raises(TypeError, match="float64"):
        log(torch.ones(3))
    with pytest.raises(ValueError, match="contiguous float64"):
        exp_nonpositive(torch.zeros(3, dtype=torch.float64), out=torch.zeros(4, dtype=torch.float64))


def test_sums_add_left_to_right_whatever_the_blocks(monkeypatch):
    """``ordered_sum`` is Python's left-to-right float sum of each row; ``exp_sum`` is ``ordered_sum`` of
    ``exp_nonpositive`` of the shifted row, float32 rows included; and neither changes a bit when the blocks they
    run in are cut small (a block of rows, of elements, the last one short)."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.rand(5, 1001, generator=generator, dtype=torch.float64) * torch.logspace(-20, 20, 1001)  # [5, n]
    assert ordered_sum(rows)[:, 0].tolist() == [functools.reduce(operator.add, row) for row in rows.tolist()]
    logits = torch.rand(2, 3, 1001, generator=generator) * 40 - 20  # [2, 3, n] float32
    largest = logits.amax(dim=-1, keepdim=True).double()  # [2, 3, 1]
    whole = exp_sum(logits, largest)  # [2, 3, 1]
    assert torch.equal(whole, ordered_sum(exp_nonpositive(logits.double() - largest)))
    monkeypatch.setattr(exactmath, "CPU_BLOCK", 300)
    monkeypatch.setattr(exactmath, "SUM_BLOCK", 2500)
    assert torch.equal(exp_sum(logits, largest), whole)
    assert torch.equal(ordered_sum(rows), ordered_sum(rows.clone()))
    assert torch.equal(exp_nonpositive(-rows), exp_nonpositive(-rows.flatten()).view(rows.shape))


def test_warp_rows_gives_strided_logits_the_bits_of_contiguous_ones():
    logits = random_logits(3, 2, 300, seed=9).transpose(0, 1)  # [2, 3, V], not contiguous
    params = RowParams.of([SamplingParams(temperature=0.9, top_k=20), SamplingParams(temperature=1.2, top_p=0.7)])
    assert torch.equal(warp_rows(logits, params), warp_rows(logits.contiguous(), params))


def test_scored_gives_the_log_softmax_of_the_chosen_and_the_top_tokens():
    """Within 1e-12 of torch's ``log_softmax`` (which differs from host to host in the last bits); the top ids are the
    largest logprobs, largest first, and a top id's logprob is the same bits as that token's when chosen."""
    logits = random_logits(2, 3, 500, seed=7)  # [2, 3, V] float32
    tokens = torch.randint(0, 500, (2, 3), generator=torch.Generator().manual_seed(8))  # [2, 3]
    packed = scored(torch.cat([logits, logits]), torch.cat([tokens, logits.argmax(dim=-1)]), 5)  # [4, 3, 11]
    reference = torch.log_softmax(logits.double(), dim=-1)  # [2, 3, V]
    chosen, ids, values = packed[..., :1].view(torch.float64), packed[..., 1:6], packed[..., 6:].view(torch.float64)
    torch.testing.assert_close(chosen[:2], reference.gather(-1, tokens[..., None]), rtol=0, atol=1e-12)
    assert torch.equal(ids[:2], reference.topk(5, dim=-1).indices)
    assert torch.equal(values[:2], values[:2].sort(dim=-1, descending=True).values)
    torch.testing.assert_close(values[:2], reference.topk(5, dim=-1).values, rtol=0, atol=1e-12)
    assert torch.equal(chosen[2:, :, 0], values[2:, :, 0])  # the argmax, chosen: its top-1 bits


@pytest.fixture(scope="module")
def digests_here() -> dict[str, dict[str, str]]:
    """This process's digests (tests/dispatch_digests.py) with 1, 2 and 16 threads."""
    return {str(threads): dispatch_digests.digests(threads) for threads in dispatch_digests.THREADS}


@pytest.fixture(scope="module")
def dispatch_processes():
    """One process per dispatch of ``DISPATCHES`` this CPU runs, started together (each takes about 2 s, mostly
    importing torch), printing the digests of tests/dispatch_digests.py; killed if a test left one running."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    names = ["default"] + (["avx2"] if CAPABILITY in ("AVX2", "AVX512") else [])
    processes = {
        name: subprocess.Popen(
            [sys.executable, dispatch_digests.__file__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**environment, "ATEN_CPU_CAPABILITY": name},
        )
        for name in names
    }
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_sampler_and_logprobs_are_the_same_bits_on_every_thread_count(digests_here):
    """warp_rows (temperature, top-k, top-p), scored, exp and log in this process with 1, 2 and 16 threads."""
    assert digests_here["1"] == digests_here["2"] == digests_here["16"]


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_the_sampler_and_logprobs_are_the_same_bits_under_each_dispatch(dispatch, digests_here, dispatch_processes):
    """A process of its own with torch dispatched to ``dispatch`` (its scalar code, or AVX2 on an AVX-512 CPU) gives
    this process's bits with every thread count. torch's own ``softmax`` fails this: on an AVX-512 Zen 4 its
    probabilities hashed differently under each of the three dispatches, and ``log_softmax`` under AVX-512 differed
    from the other two."""
    out, err = dispatch_processes[dispatch].communicate(timeout=120)
    if dispatch_processes[dispatch].returncode != 0:
        raise AssertionError(f"the {dispatch} process failed:\n{err}")
    assert json.loads(out) == digests_here


# ---- counter-based randomness --------------------------------------------------------------------------


def reference_mix64(x: int) -> int:
    """splitmix64 on Python ints (unsigned, explicitly masked)."""
    x = (x + 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def to_unsigned(values: torch.Tensor) -> list[int]:
    return [v & U64 for v in values.tolist()]


def test_mix64_matches_unsigned_splitmix64():
    inputs = [0, 1, 2**31, 2**62 + 12345, 2**63 - 1, -1, -(2**63), -987654321]
    got = to_unsigned(mix64(torch.tensor(inputs, dtype=torch.int64)))
    assert got == [reference_mix64(x & U64) for x in inputs]
    assert got[0] == 0xE220A8397B1DCDAF  # the first splitmix64 output for seed 0


def test_uniforms_match_a_python_reference():
    seeds, positions = [0, 7, 2**62 + 3], [[0, 1, 5], [100, 2, 9], [123456789, 0, 3]]
    got = uniforms(torch.tensor(seeds), torch.tensor(positions), Stream.RECOVER)
    for i, seed in enumerate(seeds):
        for j, pos in enumerate(positions[i]):
            bits = reference_mix64(reference_mix64(seed) ^ reference_mix64(pos * 3 + 2))
            assert got[i, j].item() == (bits >> 11) * 2.0**-53


def test_uniforms_are_deterministic_and_differ_by_seed_position_and_stream():
    seeds = torch.tensor([11, 11, 12])
    positions = torch.tensor([[4, 5], [4, 5], [4, 5]])
    first = uniforms(seeds, positions, Stream.ACCEPT)
    assert torch.equal(first, uniforms(seeds, positions, Stream.ACCEPT))
    assert torch.equal(first[0], first[1])
    assert first[0, 0] != first[0, 1] and first[0, 0] != first[2, 0]
    streams = [uniforms(seeds, positions, s)[0, 0].item() for s in Stream]
    assert len(set(streams)) == len(Stream)
    assert bool(((first >= 0) & (first < 1)).all())


def test_a_rows_uniforms_do_not_depend_on_the_rest_of_the_batch():
    seeds = torch.tensor(derive_row_seeds(5, 64))
    positions = torch.randint(0, 1000, (64, 6), generator=torch.Generator().manual_seed(1))
    batched = uniforms(seeds, positions, Stream.DRAFT)  # [64, 6]
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(uniforms(seeds[order], positions[order], Stream.DRAFT), batched[order])
    for row in [0, 17, 63]:
        assert torch.equal(uniforms(seeds[row : row + 1], positions[row : row + 1], Stream.DRAFT)[0], batched[row])


def test_row_random_positions_follow_the_offsets():
    rand = RowRandom(seeds=torch.tensor([3, 4]), offsets=torch.tensor([0, 10]))
    assert rand.positions(3).tolist() == [[0, 1, 2], [10, 11, 12]]
    later = RowRandom(seeds=torch.tensor([3, 4]), offsets=torch.tensor([2, 12]))
    assert torch.equal(rand.uniforms(Stream.ACCEPT, 3)[:, 2], later.uniforms(Stream.ACCEPT, 1)[:, 0])


@pytest.mark.parametrize("layout", ["consecutive_seeds", "consecutive_positions"])
def test_uniforms_are_uniform(layout):
    n = 100_000
    if layout == "consecutive_seeds":
        values = uniforms(torch.arange(n), torch.zeros(n, 1, dtype=torch.int64), Stream.DRAFT)
    else:
        values = uniforms(torch.tensor([42]), torch.arange(n)[None, :], Stream.DRAFT)
    assert stats.kstest(values.flatten().numpy(), "uniform").pvalue > 0.01
    other = uniforms(torch.arange(n), torch.zeros(n, 1, dtype=torch.int64), Stream.ACCEPT)
    assert abs(stats.pearsonr(values.flatten().numpy(), other.flatten().numpy()).statistic) < 0.02


def test_uniforms_reject_bad_inputs():
    with pytest.raises(ValueError, match="int64"):
        uniforms(torch.tensor([1], dtype=torch.int32), torch.tensor([[0]]), Stream.DRAFT)
    with pytest.raises(ValueError, match="positions"):
        uniforms(torch.tensor([1]), torch.tensor([[-1]]), Stream.DRAFT)
    with pytest.raises(ValueError, match="positions"):
        uniforms(torch.tensor([1, 2]), torch.tensor([[0]]), Stream.DRAFT)


def test_derive_row_seeds():
    seeds = derive_row_seeds(7, 1000)
    assert seeds == derive_row_seeds(7, 1000) and len(set(seeds)) == 1000
    assert derive_row_seeds(7, 3) == seeds[:3], "a prompt's seed depends on its index, not on the prompt count"
    assert derive_row_seeds(8, 3) != seeds[:3]
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_row_seeds([5, 0, 2**63 - 1], 3) == [5, 0, 2**63 - 1]
    fresh = derive_row_seeds(None, 4)
    assert len(fresh) == 4 and fresh != derive_row_seeds(None, 4)
    assert derive_row_seeds(3, 0) == []


@pytest.mark.parametrize(
    ("seed", "n", "match"),
    [
        ([1, 2], 3, "one seed per prompt"),
        (-1, 2, "seed"),
        (2**63, 2, "seed"),
        ([1, "2"], 2, "seed"),
        (1.5, 2, "seed"),
        (True, 2, "seed"),
        ("12", 2, "seed"),
        (1, -1, "n_prompts"),
    ],
)
def test_derive_row_seeds_rejects_bad_input(seed, n, match):
    with pytest.raises(ValueError, match=match):
        derive_row_seeds(seed, n)


def test_round_sampling_marks_the_rows_that_sample():
    settings = [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=3)]
    rows = dict(rows=(1, 2), index=torch.tensor([1, 2]))
    sampling = RoundSampling(params=RowParams.of(settings), rand=batch_random(15, rows=3), **rows)
    assert sampling.sampled.tolist() == [False, True, True] and sampling.any_sampled
    assert sampling.greedy_rows(3) == [True, False, False]
    with pytest.raises(ValueError, match="one setting and one seed per row"):
        RoundSampling(params=RowParams.of(settings), rand=batch_random(15, rows=2), **rows)
    with pytest.raises(ValueError, match="on the host and on the device alike"):
        RoundSampling(params=RowParams.of(settings), rand=batch_random(15, rows=3), rows=(1,), index=rows["index"])


def test_rows_of_one_batch_are_warped_by_their_own_settings():
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=7, top_p=0.8),
    ]
    logits = random_logits(len(settings), 3, 40)  # [B, k+1, V]
    together = warp_rows(logits, RowParams.of(settings))  # [B, k+1, V]
    for i, params in enumerate(settings):
        assert torch.equal(together[i], warp(logits[i], params)), params  # bit for bit: rows never mix


# ---- inverse-CDF draws ------------------------------------------------------------------------------------


def test_inverse_cdf_never_draws_a_zero_mass_token():
    top = 1 - 2.0**-53
    probs = torch.tensor([[0, 0.5, 0, 0.5, 0]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, top, 0.5, 0.4999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 3, 3, 1]
    assert inverse_cdf(probs * 7, u).tolist() == [1, 3, 3, 1], "unnormalised weights give the same draws"
    tiny = torch.tensor([[1e-300, 1.0, 0.0]] * 2, dtype=torch.float64)
    assert inverse_cdf(tiny, torch.tensor([0.0, top])).tolist() == [0, 1]


def test_sample_draft_follows_q():
    q = GENERIC_Q.expand(ROWS, -1)  # [B, V]
    tokens = sample_draft(q, batch_random(3).uniforms(Stream.DRAFT, 1)[:, 0])
    assert chi2_pvalue(tokens, GENERIC_Q) > PASS_P
    with pytest.raises(ValueError, match="q"):
        sample_draft(GENERIC_Q, torch.zeros(1))


# ---- speculative-sampling verification ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_emitted_position_follows_p(case):
    results = position_pvalues(case, seed=100)
    reachable = 1 if case == "disjoint" else len(results)  # disjoint supports reject every d_1
    for reached, pvalue in results[:reachable]:
        assert reached >= 2000 and pvalue > PASS_P, (case, reached, pvalue)
    assert all(reached == 0 for reached, _ in results[reachable:])


def test_acceptance_rates():
    k = 2
    same = run_round(*CASES["q_equals_p"], batch_random(1)).verdict
    assert bool((same.accepted == k).all())
    disjoint = run_round(*CASES["disjoint"], batch_random(2)).verdict
    assert bool((disjoint.accepted == 0).all())
    p_steps, q_steps = CASES["generic"]
    generic = run_round(p_steps, q_steps, batch_random(3)).verdict
    beta = float(torch.minimum(p_steps[0], q_steps[0]).sum())  # sum_x min(p(x), q(x)) = 0.6
    rate = float((generic.accepted >= 1).double().mean())
    assert abs(rate - beta) < 5 * math.sqrt(beta * (1 - beta) / ROWS), (rate, beta)


def test_identical_p_and_q_emit_the_drafts():
    r = run_round(*CASES["q_equals_p"], batch_random(4))
    assert torch.equal(r.verdict.tokens, r.drafts)


def test_plain_sampling_is_the_draft_stream_applied_to_p():
    """With q = p a row gains its drafts, so plain target sampling should draw from p with Stream.DRAFT."""
    rand = batch_random(6, rows=500)
    p = warp(random_logits(500, 3, 40), SamplingParams(temperature=0.9, top_p=0.95))  # [B, k+1, V]
    drafts = inverse_cdf(p, rand.uniforms(Stream.DRAFT, 3))  # [B, k+1]
    assert torch.equal(verify_sampling(drafts, p, p, rand).tokens, drafts)


def test_a_row_without_a_draft_draws_from_p_with_the_draft_stream():
    rand = batch_random(14)
    p = GENERIC_P.expand(ROWS, 1, -1)  # [B, 1, V]
    nothing = torch.zeros(ROWS, dtype=torch.long)  # [B]: no drafts, no draft for the bonus position either
    filler = torch.full((ROWS, 1), 3)  # [B, 1]
    verdict = verify_sampling(filler, p, p, rand, lengths=nothing, bonus_drafted=nothing.bool())
    assert bool((verdict.accepted == 0).all()) and verdict.tokens.shape == (ROWS, 1)
    assert torch.equal(verdict.tokens[:, 0], inverse_cdf(p[:, 0], rand.uniforms(Stream.DRAFT, 1)[:, 0]))
    assert chi2_pvalue(verdict.tokens[:, 0], GENERIC_P) > PASS_P
    assert torch.equal(verify_sampling(verdict.tokens, p, p, rand).tokens, verdict.tokens), "as a draft q = p would"


def test_rows_stop_at_their_own_length():
    """Drafts past a row's length are never accepted, and its final token is decided at that length."""
    rand = batch_random(21, rows=ROWS)
    p = GENERIC_P.expand(ROWS, 3, -1)  # [B, k+1, V]
    drafts = inverse_cdf(p, rand.uniforms(Stream.DRAFT, 3))  # [B, k+1]: q = p accepts every draft
    lengths = torch.tensor([0, 1, 2] * (ROWS // 3) + [2] * (ROWS % 3))  # [B]
    verdict = verify_sampling(drafts, p, p, rand, lengths=lengths)
    assert torch.equal(verdict.accepted, lengths)
    final = verdict.tokens.gather(1, lengths[:, None]).squeeze(1)  # [B]
    assert torch.equal(final, drafts.gather(1, lengths[:, None]).squeeze(1)), "the bonus draft at the length"


def test_a_drafted_token_with_tiny_q_is_decided_by_p():
    rows = 1000
    q = dist(1e-300, 1, 1, 1).expand(rows, 1, -1)  # [B, 1, V]
    drafts = torch.zeros(rows, 1, dtype=torch.long)
    rand = batch_random(7, rows=rows)
    kept = verify_sampling(drafts, q, dist(0.5, 0.5, 0, 0).expand(rows, 1, -1), rand)
    assert kept.tokens[:, 0].tolist() == [0] * rows
    dropped = verify_sampling(drafts, q, dist(0, 0.5, 0.5, 0).expand(rows, 1, -1), rand)
    assert set(dropped.tokens[:, 0].tolist()) == {1, 2}


@dataclass(frozen=True)
class RejectAll(RowRandom):
    """Accept uniforms of ``1 - 2**-53``: rejects every draft with ``p(d) < q(d)``, however slightly."""

    def uniforms(self, stream: Stream, m: int) -> torch.Tensor:
        values = super().uniforms(stream, m)
        return torch.full_like(values, 1 - 2.0**-53) if stream == Stream.ACCEPT else values


def test_residual_zero_by_rounding_falls_back_to_p():
    q = torch.softmax(random_logits(6, seed=3).double(), dim=-1)  # [V]
    p = torch.nextafter(q, torch.zeros_like(q))  # p < q by one ulp everywhere: max(0, p - q) == 0
    assert bool((p < q).all()) and float((p - q).clamp(min=0).sum()) == 0
    base = batch_random(8)
    rand = RejectAll(seeds=base.seeds, offsets=base.offsets)
    r = run_round(p[None], q[None], rand)
    recovered = r.verdict.tokens[:, 0]
    assert bool((recovered != r.drafts[:, 0]).any())
    assert torch.equal(recovered, inverse_cdf(p.expand(ROWS, -1), base.uniforms(Stream.RECOVER, 1)[:, 0]))
    assert chi2_pvalue(recovered, p) > PASS_P


def test_rows_are_verified_independently_of_the_batch():
    p_steps, q_steps = CASES["generic"]
    rand = batch_random(9, rows=200)
    whole = run_round(p_steps, q_steps, rand).verdict
    order = torch.randperm(200, generator=torch.Generator().manual_seed(0))[:37]
    part = run_round(p_steps, q_steps, RowRandom(seeds=rand.seeds[order], offsets=rand.offsets[order])).verdict
    assert torch.equal(part.accepted, whole.accepted[order]) and torch.equal(part.tokens, whole.tokens[order])


def test_one_hot_p_and_q_reduce_to_greedy_verification():
    target_logits = random_logits(300, 4, 12, seed=1)  # [B, k+1, V]
    draft_logits = target_logits + random_logits(300, 4, 12, seed=2) / 4  # agrees with the target often
    p, q = warp(target_logits, SamplingParams()), warp(draft_logits, SamplingParams())
    drafts = draft_logits.argmax(dim=-1)  # [B, k+1]
    sampled = verify_sampling(drafts, q, p, batch_random(10, rows=300))
    greedy = verify_greedy(drafts[:, :-1], target_logits)
    assert torch.equal(sampled.accepted, greedy.accepted)
    assert 0 < float(greedy.accepted.double().mean()) < 3
    mask = torch.arange(4) < greedy.gained[:, None]  # [B, k+1]
    assert torch.equal(sampled.tokens[mask], greedy.tokens[mask])


def test_verify_sampling_rejects_mismatched_shapes():
    rand = batch_random(11, rows=2)
    p = GENERIC_P.expand(2, 3, -1)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_sampling(torch.zeros(2, 0, dtype=torch.long), p[:, :0], p[:, :0], rand)
    with pytest.raises(ValueError, match="q and p"):
        verify_sampling(torch.zeros(2, 2, dtype=torch.long), p, p, rand)
    with pytest.raises(ValueError, match="seed"):
        verify_sampling(torch.zeros(1, 3, dtype=torch.long), p[:1], p[:1], rand)


# ---- deliberately wrong verifiers fail the same tests ----------------------------------------------------

WRONG = {
    "recovered_from_p": ("_residual", lambda p, q: p, "generic", 1),
    "ratio_inverted": ("_accept", lambda u, p, q: u * p < q, "generic", 1),
    "bonus_from_q": ("_accept", lambda u, p, q: torch.ones_like(u, dtype=torch.bool), "bonus_after_all_accepted", 3),
}


@pytest.mark.parametrize("variant", list(WRONG))
def test_a_wrong_verifier_fails_the_chi_square_test(variant, monkeypatch):
    helper, wrong, case, position = WRONG[variant]
    assert position_pvalues(case, seed=100)[position - 1][1] > PASS_P
    monkeypatch.setattr(verifier, helper, wrong)
    assert position_pvalues(case, seed=100)[position - 1][1] < FAIL_P


# ---- tokens do not depend on how generation is cut into rounds --------------------------------------------


def position_tables(length: int = 256, vocab: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q ``[T, V]`` for each absolute output position, with some zero-mass tokens."""
    gen = torch.Generator().manual_seed(12)
    p = torch.rand(length, vocab, generator=gen, dtype=torch.float64) * (torch.rand(length, vocab, generator=gen) > 0.3)
    q = torch.rand(length, vocab, generator=gen, dtype=torch.float64) * (torch.rand(length, vocab, generator=gen) > 0.3)
    p[:, 0] += 0.01
    q[:, 1] += 0.01
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def generate(seeds: torch.Tensor, ks: list[int], length: int = 24, verify=verify_sampling) -> torch.Tensor:
    """``[B, length]`` tokens from rounds of ``ks[r % len(ks)]`` drafts; p and q depend on the position only."""
    p_table, q_table = position_tables()
    assert p_table.shape[0] >= (length + 1) * (max(ks) + 1), "a row may run ahead while others catch up"
    out = torch.full((seeds.shape[0], p_table.shape[0]), -1)  # [B, T]
    done = torch.zeros_like(seeds)  # [B]
    for r in range(length):
        if int(done.min()) >= length:
            break
        k = ks[r % len(ks)]
        rand = RowRandom(seeds=seeds, offsets=done)
        positions = rand.positions(k + 1)  # [B, k+1]
        p, q = p_table[positions], q_table[positions]  # [B, k+1, V]
        verdict = verify(inverse_cdf(q, rand.uniforms(Stream.DRAFT, k + 1)), q, p, rand)
        gained = torch.arange(k + 1) < verdict.gained[:, None]  # [B, k+1]
        out.scatter_(1, positions, torch.where(gained, verdict.tokens, out.gather(1, positions)))
        done = done + verdict.gained
    return out[:, :length]


def bonus_from_p(draft_tokens, q, p, rand):
    """A textbook verifier that draws the bonus token from p_{k+1} directly (right marginal, wrong realisation)."""
    verdict = verify_sampling(draft_tokens, q, p, rand)
    k = draft_tokens.shape[1] - 1
    bonus = inverse_cdf(p[:, k], rand.uniforms(Stream.RECOVER, k + 1)[:, k])  # [B]
    tokens = verdict.tokens.clone()
    tokens[:, k] = torch.where(verdict.accepted == k, bonus, tokens[:, k])
    return Verdict(accepted=verdict.accepted, tokens=tokens)


def test_tokens_do_not_depend_on_round_structure_or_batch():
    seeds = torch.tensor(derive_row_seeds(13, 64))
    reference = generate(seeds, ks=[1])
    p_table, _ = position_tables()
    assert bool((p_table[torch.arange(reference.shape[1]), reference] > 0).all()), "a token of zero target mass"
    for ks in ([0], [4], [3, 0, 5, 1]):
        assert torch.equal(generate(seeds, ks=ks), reference), ks
    assert torch.equal(generate(seeds[10:13], ks=[2]), reference[10:13])
    assert not torch.equal(generate(seeds, ks=[3], verify=bonus_from_p), reference)
