"""The exact int8 forward (``--quantize int8``, :mod:`batchspec.exact.integer`).

* Arithmetic: each building block computes what it claims (quantization, exp, fixed-order sums, the exact SiLU,
  the correctly rounded square root, exact integer products, also through the two-halves path for ``_int_mm``).
* The property the mode exists for: a row's logits are bit-identical whatever else is in the forward (other rows,
  left padding, how many new tokens a forward takes), against the row run alone one token at a time.
* Through batchspec: every method and proposer equals the quantized model's own ``generate`` exactly, seeded
  sampling gives each prompt the same tokens at any batch size and k, and sampled tokens follow the quantized
  target's distribution (chi-square).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import platform
import subprocess
import sys
from fractions import Fraction

import mpmath
import pytest
import tiny_models
import torch
from helpers import exact_joint, joint_pvalue
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged import alone_one_token_at_a_time, ragged_forwards

import batchspec
from batchspec.config import SamplingParams
from batchspec.exact.integer import attention, check_quantize, linear, native, product, quantization, quantize_model
from batchspec.exact.integer.arithmetic import (
    EXP2_COEFFICIENTS,
    exact_gelu_tanh,
    exact_silu,
    exact_softcap,
    exp2_nonpositive,
    quantize_rows,
    row_sum,
    sqrt_rounded,
)
from batchspec.exact.integer.attention import QKV_LEVELS, QUERY_CHUNK, exact_attention, pack
from batchspec.exact.integer.linear import Int8Linear
from batchspec.exact.integer.model import ExactRMSNorm, check_quantizable, exact_rms_norm, split_fused
from batchspec.exact.integer.product import (
    KERNELS,
    activation_codes,
    exact_kernels,
    int_product,
    pack_weight,
    product_kernel,
    split_weight,
)
from batchspec.exact.integer.rotary import (
    CorrectlyRoundedPow,
    RotaryTable,
    correctly_rounded,
    correctly_rounded_frequencies,
    mp_rounded,
)
from batchspec.exact.integer.smoothing import calibration_ids, calibration_peaks, decoder_layers, smooth_layer
from batchspec.families import positions_of

KINDS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def quantized(bundles) -> dict[str, tuple]:
    """``kind -> (int8 target, int8 perturbed draft, bundle)``: copies of the float64 tiny models, quantized."""
    out = {}
    for kind in KINDS:
        bundle = bundles[kind]
        target = quantize_model(copy.deepcopy(bundle.target))
        draft = quantize_model(copy.deepcopy(bundle.drafts["perturbed"]))
        out[kind] = (target, draft, bundle)
    return out


@pytest.fixture(scope="module")
def quantized_float32(bundles) -> dict[str, torch.nn.Module]:
    """``kind -> int8 target`` made from a float32 copy, its layers on this CPU's two fastest exact kernels: the MLP
    and output layers on the fastest (``native`` or ``onednn`` where the CPU runs them), the attention's smaller
    projections on the next (so one shared quantization feeds both)."""
    fastest, *others = exact_kernels(torch.float32)
    second = others[0] if others else fastest
    out = {}
    for kind in KINDS:
        model = copy.deepcopy(bundles[kind].target).float()
        large = model.model.layers[0].mlp.gate_proj.weight.numel()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear, "product_kernel", lambda _, size, large=large: fastest if size >= large else second)
            out[kind] = quantize_model(model)
    return out


# ------------------------------------------------------------------------------------------------ arithmetic


def test_quantize_rows_worked_example():
    q, scale = quantize_rows(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert q.tolist() == [[64.0, -127.0, 32.0], [0.0, 0.0, 0.0]]
    assert scale.tolist() == [[1.0 / 127], [1.0]]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-8), (torch.float32, 4e-6)])
def test_exp2_nonpositive_is_accurate(dtype, tolerance):
    t = -torch.linspace(0, 120, 100_001, dtype=torch.float64).to(dtype)
    want = torch.exp2(t.double())
    got = exp2_nonpositive(t.clone()).double()
    assert ((got - want).abs() / want).max().item() < tolerance
    assert exp2_nonpositive(torch.tensor([0.0, -1.0, -3.0], dtype=dtype)).tolist() == [1.0, 0.5, 0.125]


def _assert_nearest_roots(x: torch.Tensor, root: torch.Tensor) -> None:
    """Each float32 ``r`` of ``root`` is the nearest to the exact root of its positive ``x``, checked in exact
    rationals: the midpoints to its neighbours, squared, bracket ``x``."""
    assert root.dtype == torch.float32
    up, down = (torch.nextafter(root, torch.tensor(limit)) for limit in (math.inf, -math.inf))
    for value, r, above, below in zip(x.tolist(), root.tolist(), up.tolist(), down.tolist(), strict=True):
        low, high = ((Fraction(r) + Fraction(neighbour)) / 2 for neighbour in (below, above))
        assert low**2 <= Fraction(value) <= high**2


def _scattered_float32(count: int, seed: int) -> torch.Tensor:
    """``count`` positive float32 values over every binade, subnormals and the largest values included."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.rand(count, generator=generator) + 0.5) * 2.0 ** torch.randint(-149, 127, (count,), generator=generator)
    return torch.cat([x[x > 0], torch.tensor([1e-45, 2.0**-126, 1.0, 2.0, 3.4028235e38])])


def test_sqrt_rounded_is_the_correctly_rounded_root():
    """RMSNorm's and the smoothing's roots: for 3,000 float32 values over every binade, the float32 returned is the
    nearest to the exact root; zero, infinity, NaN and negative values keep IEEE's root."""
    x = _scattered_float32(3000, seed=5)
    _assert_nearest_roots(x, sqrt_rounded(x))
    edges = sqrt_rounded(torch.tensor([0.0, -0.0, math.inf, math.nan, -1.0]))
    assert edges[:3].tolist() == [0.0, 0.0, math.inf] and edges[1].signbit() and edges[3:].isnan().all()


def test_sqrt_rounded_does_not_depend_on_the_accuracy_of_torchs_root(monkeypatch):
    """torch's float64 root comes from a vector library whose first call in a process was once far off on one thread
    (:func:`~batchspec.exact.integer.rotary.correctly_rounded`): with every root torch gives 1e-4 of its size off,
    each value either way, ``sqrt_rounded`` still returns the nearest float32 root."""
    x = _scattered_float32(2000, seed=6)
    exact_sqrt = torch.Tensor.sqrt
    signs = torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(7)) < 0.5, -1.0, 1.0).double()

    def off(t: torch.Tensor) -> torch.Tensor:
        return exact_sqrt(t) * (1.0 + 1e-4 * signs) if t.shape == x.shape else exact_sqrt(t)

    monkeypatch.setattr(torch.Tensor, "sqrt", off)
    monkeypatch.setattr(torch.Tensor, "sqrt_", lambda t: t.copy_(off(t)))
    monkeypatch.setattr(torch, "sqrt", off)
    _assert_nearest_roots(x, sqrt_rounded(x))


def _nearest_float32(value: float, exact) -> bool:
    """Whether the float32 ``value`` is as near to ``exact`` (an mpmath number) as either float32 neighbour."""
    up, down = (torch.nextafter(torch.tensor(value), torch.tensor(d)).item() for d in (1e9, -1e9))
    return abs(exact - value) <= min(abs(exact - up), abs(exact - down))


def test_the_rotary_tables_cos_and_sin_are_correctly_rounded():
    """The rotary table's values on 300 float32 angles up to 2**15 (positions times frequencies), through float64
    and, for 30 of them, through the 100-bit path float64's near-ties take: each the float32 nearest to the exact
    value."""
    generator = torch.Generator().manual_seed(7)
    angles = torch.rand(300, generator=generator) * 2.0 ** torch.randint(-10, 16, (300,), generator=generator)
    for function in ("cos", "sin"):
        got = correctly_rounded(angles, function)
        for i, (angle, value) in enumerate(zip(angles.tolist(), got.tolist(), strict=True)):
            with mpmath.workprec(100):
                exact = getattr(mpmath, function)(mpmath.mpf(angle))
            assert _nearest_float32(value, exact), (function, angle)
            if i < 30:
                assert mp_rounded(angle, function) == value, (function, angle)


def test_the_rotary_tables_values_do_not_depend_on_torchs_cos_and_sin(monkeypatch):
    """torch's float64 ``cos`` of a large tensor runs MKL's vector library, whose first call in a process once gave
    one thread's half of a table values up to 6.6e-8 of their size off: with torch's ``cos`` and ``sin`` that far off,
    the table's values are still each the float32 nearest to the exact value."""
    def off(function):
        def value(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return function(x, *args, **kwargs) * (1.0 + 6.6e-8)
        return value

    for name in ("cos", "sin"):
        monkeypatch.setattr(torch, name, off(getattr(torch, name)))
        monkeypatch.setattr(torch.Tensor, name, off(getattr(torch.Tensor, name)))
    generator = torch.Generator().manual_seed(8)
    angles = torch.rand(200, generator=generator) * 2.0 ** torch.randint(-10, 16, (200,), generator=generator)
    for function in ("cos", "sin"):
        got = correctly_rounded(angles, function)
        for angle, value in zip(angles.tolist(), got.tolist(), strict=True):
            with mpmath.workprec(100):
                exact = getattr(mpmath, function)(mpmath.mpf(angle))
            assert _nearest_float32(value, exact), (function, angle)


def test_the_rotary_frequencies_are_the_rope_functions_with_pow_correctly_rounded():
    """Qwen's base 10**6 and head size 128, where torch's AVX2 and AVX-512 ``pow`` round ``base ** (74 / 128)`` the
    other way: each frequency is ``1 / p``, ``p`` the float32 nearest to ``base ** (2 i / 128)`` (exact in mpmath),
    on every host and dispatch; and the table's angles turn at those frequencies."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    rotary = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=1536, num_attention_heads=12, rope_theta=1e6))
    got = correctly_rounded_frequencies(rotary)
    exponents = torch.arange(0, 128, 2, dtype=torch.float32) / 128
    for frequency, exponent in zip(got.tolist(), exponents.tolist(), strict=True):
        with mpmath.workprec(200):
            exact = mpmath.power(10**6, mpmath.mpf(exponent))
        power = min(_neighbours(float(exact)), key=lambda p: abs(mpmath.mpf(p) - exact))
        assert frequency == (torch.tensor(1.0) / torch.tensor(power, dtype=torch.float32)).item()
    table = RotaryTable(rotary, 4, torch.float32)
    assert table.cos[1, :64].tolist() == correctly_rounded(got, "cos").tolist()


def _neighbours(value: float) -> list[float]:
    """The float32 nearest to ``value`` by float64's rounding and its two neighbours."""
    middle = torch.tensor(value).float()
    return [torch.nextafter(middle, torch.tensor(d)).item() for d in (-1e9, 1e9)] + [middle.item()]


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "linear", "factor": 2.0},
])
def test_every_static_rope_type_gets_its_frequencies_with_pow_correctly_rounded(scaling):
    """The rope types the exact model takes: their own functions run with the correctly rounded ``pow``, which every
    ``base ** tensor`` in them meets (a spy counts it), within a float32 rounding of torch's values."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_scaling=scaling, max_position_embeddings=4096,
                         rope_theta=500000.0)
    rotary = LlamaRotaryEmbedding(config)
    calls = []
    original = CorrectlyRoundedPow.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        result = original(self, func, types, args, kwargs)
        if func is torch.Tensor.__rpow__:
            calls.append(func)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CorrectlyRoundedPow, "__torch_function__", spy)
        got = correctly_rounded_frequencies(rotary)
    assert calls, "the rope function's base ** exponents went past the correctly rounded pow"
    torch.testing.assert_close(got, rotary.inv_freq, rtol=2.0**-22, atol=0.0)


def test_longrope_holds_the_short_factors_table_up_to_the_original_length_and_refuses_past_it():
    """Phi-3's LongRoPE: transformers turns a forward whose last position is below
    ``original_max_position_embeddings`` (256 here, of 512) by the short factors, and every position of one that
    reaches past it by the long ones. The exact table holds the short factors' 256 positions, as wide as the part of a
    head that turns (partial rotary), and refuses position 256."""
    model = tiny_models.build_phi3(seed=1).float()
    check_quantizable(model)
    rotary, config = model.model.rotary_emb, model.config
    assert positions_of(config) == 256 and config.max_position_embeddings == 512
    table = RotaryTable(rotary, positions_of(config), torch.float32)
    x = torch.zeros(1, dtype=torch.float32)
    short = rotary(x, torch.arange(256)[None])  # [1, 256, R] each: the short factors
    long = rotary(x, torch.arange(257)[None])  # reaching past: the long factors at every position
    size = model.model.layers[0].self_attn.head_dim
    assert table.cos.shape == (256, 2 * rotary.inv_freq.numel()) and table.cos.shape[1] < size
    for got, want in zip(table(x, torch.arange(256)[None]), short, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert not torch.allclose(long[0][:, 1:256], short[0][:, 1:])
    with pytest.raises(ValueError, match="past the 256 positions"):
        table(x, torch.tensor([[3, 256]]))


def test_split_projections_give_the_fused_layers_bits():
    """Phi-3's qkv_proj and gate_up_proj split into a Llama's layers (:func:`split_fused`): each part's int8 product
    is the fused weight's int8 product at its outputs, and the attention's qkv_proj still gives the three side by
    side."""
    model = tiny_models.build_phi3(seed=1, hidden_size=128, intermediate_size=192).float()
    layer = model.model.layers[0]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    fused_qkv, fused_gate_up = Int8Linear(layer.self_attn.qkv_proj), Int8Linear(layer.mlp.gate_up_proj)
    want_qkv, want_gate_up = fused_qkv(x), fused_gate_up(x)
    split_fused(model)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert {name for name, _ in attention.named_children()} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    parts = [Int8Linear(p) for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert torch.equal(torch.cat([part(x) for part in parts], -1), want_qkv)
    assert torch.equal(torch.cat([Int8Linear(p)(x) for p in (mlp.gate_proj, mlp.up_proj)], -1), want_gate_up)
    torch.testing.assert_close(attention.qkv_proj(x), torch.cat([p(x) for p in (attention.q_proj, attention.k_proj,
                                                                                attention.v_proj)], -1))
    copied = copy.deepcopy(attention)
    assert copied.qkv_proj.owner is copied


def test_correctly_rounded_pow_rounds_every_element_to_the_nearest_float32():
    """``base ** x`` inside the mode, 200 exponents and bases drawn over many magnitudes: each element the float32
    nearest to the exact power; a float64 pow or a zero base is left to torch."""
    generator = torch.Generator().manual_seed(11)
    exponents = torch.rand(200, generator=generator) * 4 - 2
    bases = torch.rand(200, generator=generator) * 2.0 ** torch.randint(-8, 20, (200,), generator=generator).float()
    two, half = torch.tensor([2.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    with CorrectlyRoundedPow():
        got = (bases**exponents).tolist()
        wide = two**half
        zero = torch.tensor([0.0]) ** torch.tensor([2.0])
    for value, base, exponent in zip(got, bases.tolist(), exponents.tolist(), strict=True):
        with mpmath.workprec(200):
            assert _nearest_float32(value, mpmath.power(mpmath.mpf(base), mpmath.mpf(exponent))), (base, exponent)
    assert torch.equal(wide, two**half) and zero.item() == 0.0


def test_a_rotary_module_without_a_rope_function_keeps_its_frequencies(caplog):
    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inv_freq = torch.tensor([1.0, 0.1])

    with caplog.at_level("WARNING"):
        assert torch.equal(correctly_rounded_frequencies(Rotary()), torch.tensor([1.0, 0.1]))
    assert "no rope function transformers knows" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gemma_norm_is_swapped_for_one_holding_one_plus_its_weight(dtype):
    """Gemma's RMSNorm scales by ``1.0 + w.float()``, computed on every call; the swapped norm holds ``1 + w``
    rounded once and gives transformers' product of it with the exact normalization (:func:`exact_rms_norm`'s), bit
    for bit, in float32 on the native kernels and in float64 on torch."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(48, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight, 0.0, 0.3)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(0), dtype=dtype)  # [5, 48]
    normed = x * (1.0 / sqrt_rounded(row_sum(x * x) / 48 + 1e-6))  # [5, 48]
    with torch.no_grad():
        assert torch.equal(ExactRMSNorm.offset(norm, 1.0)(x), normed * (1.0 + norm.weight))


def test_row_sum_order_is_a_pairwise_tree():
    a, b, c = 1e16, 1.0, -1e16
    # the tree adds a + c first, then b: exactly 1.0, where a left-to-right sum loses b
    assert row_sum(torch.tensor([[a, b, c]], dtype=torch.float64)).item() == 1.0
    assert (a + b) + c == 0.0


def _alone_as_batched(function, rows: torch.Tensor) -> torch.Tensor:
    """``function`` of ``rows`` ``[N, W]`` (on this CPU's native build), having asserted that each row alone gives
    the same bits, and that torch's path (no native build) does too."""
    batched = function(rows.clone())
    alone = torch.cat([function(row[None].clone()) for row in rows])
    with native.using("none"):
        torch_path = function(rows.clone())
    assert torch.equal(batched, alone) and torch.equal(batched, torch_path), rows.shape
    return batched


def test_exact_silu_gives_a_row_the_same_values_alone_and_in_a_batch():
    """torch's own SiLU gives a value of a row whose start moves in a batch a different last bit about one time in
    eight (vector path or scalar tail); the exact SiLU gives every one of 4,000 rows the values it gets alone, in C and
    in torch, and stays within a few float32 ulps of torch's."""
    torch.manual_seed(0)
    for width in (50, 128):
        rows = torch.randn(4000, width) * 4
        batched = _alone_as_batched(exact_silu, rows)
        assert torch.allclose(batched, torch.nn.functional.silu(rows), rtol=4e-6, atol=1e-7)
    assert exact_silu(torch.tensor([0.0, -1.0, 1.0])).tolist() == pytest.approx([0.0, -0.268941, 0.731059], abs=1e-6)


def test_exact_gelu_tanh_gives_a_row_the_same_values_alone_and_in_a_batch():
    """Gemma's GELU with tanh, as the SiLU: every one of 4,000 rows gets the values it gets alone, in C and in torch,
    within 16 float32 ulps of the exact (float64) GELU above -2 (the error grows with |z| below), and within 1e-6
    of it everywhere (torch's own float32 GELU loses more there: 1 + tanh(u) cancels)."""
    torch.manual_seed(0)
    for width in (50, 128):
        rows = torch.randn(4000, width) * 4
        batched = _alone_as_batched(exact_gelu_tanh, rows)
        exact = torch.nn.functional.gelu(rows.double(), approximate="tanh")
        near = rows > -2
        assert torch.allclose(batched[near].double(), exact[near], rtol=16 * 2.0**-24, atol=0.0)
        assert torch.allclose(batched.double(), exact, rtol=0.0, atol=1e-6)
    assert exact_gelu_tanh(torch.tensor([0.0, -1.0, 1.0])).tolist() == pytest.approx([0.0, -0.158808, 0.841192],
                                                                                      abs=1e-6)


def test_exact_softcap_gives_a_row_the_same_values_alone_and_in_a_batch():
    """Gemma 2's soft-cap ``cap * tanh(x / cap)``, as the SiLU: every one of 4,000 rows gets the values it gets alone,
    in C's exp2 and in torch's, within 4 float32 ulps of the cap of the exact (float64) tanh, and capped: an infinity
    gives the cap, a NaN stays NaN."""
    torch.manual_seed(0)
    for width, cap in ((50, 1.0), (128, 30.0)):
        rows = torch.randn(4000, width) * 2 * cap
        batched = _alone_as_batched(functools.partial(exact_softcap, cap=cap), rows)
        exact = torch.tanh(rows.double() / cap) * cap
        assert torch.allclose(batched.double(), exact, rtol=0.0, atol=4 * cap * 2.0**-24)
        assert bool((batched.abs() <= cap).all())
    edges = exact_softcap(torch.tensor([0.0, 1.0, -math.inf, math.inf, math.nan]), 2.0)
    assert edges[:4].tolist() == pytest.approx([0.0, 2.0 * math.tanh(0.5), -2.0, 2.0], abs=1e-6)
    assert math.isnan(edges[4])


def _extreme_operands(rows: int, inner: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (rows, inner), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (cols, inner), dtype=torch.int8, generator=generator)
    a[0], w[0], w[1] = 127, 127, -127
    return a, w


@pytest.mark.parametrize(
    "rows, inner, cols", [(1, 64, 32), (5, 256, 96), (33, 1536, 40), (48, 8960, 24), (250, 96, 70)]
)
def test_every_product_kernel_gives_the_exact_sum_rounded_once(rows, inner, cols):
    """Each kernel this CPU runs gives the exact integer sums (float64 holds them), rounded once to float32: the
    native and onednn kernels (where the CPU runs them exactly), ``_int_mm`` and its halves; 8960 inputs take sums
    past 2**24; 250 rows take two passes over the weight (csrc/scalar.h's ROW_BLOCK)."""
    a, w = _extreme_operands(rows, inner, cols)
    exact = a.double() @ w.double().T  # [N, O]
    assert exact.abs().max().item() > 2**24 or inner < 8960
    kernels = [k for k in KERNELS if k in exact_kernels(torch.float32) or k.startswith("int_mm")]
    for kernel in kernels:
        weight = pack_weight(w, kernel)
        codes = activation_codes(a.float(), kernel)
        assert torch.equal(int_product(codes, weight, torch.float32), exact.float()), kernel
    high, low = split_weight(w)
    assert high.abs().max().item() <= 64 and set(low.unique().tolist()) <= {0, 1}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_pointwise"),
                    reason="this torch has no oneDNN quantized linear")
def test_the_onednn_check_refuses_a_product_inexact_only_on_long_rows_of_a_batch(monkeypatch):
    """oneDNN's product runs only where its check finds the exact sums. On a CPU with AMX-INT8 its product is exact
    on 256 inputs at any row count but not on 1,024 inputs or more at 8 rows or more (measured on a Sapphire
    Rapids-class Xeon): a stand-in kernel wrong just there passes a check of 256 inputs and 1, 2 and 33 rows (the old
    one) and fails the check that runs, which an exact stand-in passes."""

    def stand_in(wrong: bool):
        def fake(codes, weight, dtype):  # codes: q [N, K] as float64 here; weight: w [O, K]
            exact = (codes @ weight.T).float()  # [N, O]
            if wrong and codes.shape[0] >= 8 and codes.shape[1] >= 1024:
                exact[-1, 0] = torch.nextafter(exact[-1, 0], torch.tensor(math.inf))
            return exact

        monkeypatch.setattr(product, "pack_weight", lambda w, kernel: w.double())
        monkeypatch.setattr(product, "activation_codes", lambda q, kernel: q.double())
        monkeypatch.setattr(product, "int_product", fake)

    stand_in(wrong=True)
    assert product._exact_on("onednn", *product._extreme_operands(), (1, 2, 33))
    assert not product._onednn_exact.__wrapped__()
    stand_in(wrong=False)
    assert product._onednn_exact.__wrapped__()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's ISA cap is an x86 setting")
def test_a_cpu_without_native_kernels_gets_the_same_bits(tmp_path):
    """With no native build (``BATCHSPEC_CPU_ISA=none``), oneDNN capped at AVX2 and torch's own kernels at their
    scalar code, the layer runs ``torch._int_mm`` (on the weight's two halves where this CPU's int8 product saturates,
    which the layer checks) and gives this process's output bit for bit. (Inputs come from integers: torch's
    ``randn`` itself differs between its scalar and vector code.)"""
    script = (
        "import sys, torch\n"
        "from batchspec.exact.integer.product import product_kernel\n"
        "from batchspec.exact.integer.linear import Int8Linear\n"
        "torch.manual_seed(0)\n"
        "layer = Int8Linear(torch.nn.Linear(256, 96))\n"
        "x = torch.randint(-1000, 1000, (9, 256)) / 300.0\n"
        "torch.save({'kernel': product_kernel(torch.float32), 'y': layer(x)}, sys.argv[1])\n"
    )
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", BATCHSPEC_CPU_ISA="none", ATEN_CPU_CAPABILITY="default")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    path = tmp_path / "avx2.pt"
    subprocess.run([sys.executable, "-c", script, path], env=env, check=True, timeout=120)
    capped = torch.load(path)
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(256, 96))
    assert capped["kernel"] in ("int_mm", "int_mm_split")
    assert torch.equal(capped["y"], layer(torch.randint(-1000, 1000, (9, 256)) / 300.0))


def test_the_two_halves_path_is_exact_where_int_mm_would_saturate():
    """``weight = 2 * high + low`` keeps every pair of products below what a saturating int16 sum holds
    (``2 * 255 * 64 < 2**15``), and the halves' products recombine to the exact sum."""
    a, w = _extreme_operands(5, 256, 64)
    high, low = split_weight(w)
    assert 2 * 255 * high.abs().max().item() < 2**15
    recombined = (a.double() @ high.double().T) * 2 + a.double() @ low.double().T
    assert torch.equal(recombined, a.double() @ w.double().T)
    assert torch.equal(int_product(a, pack_weight(w, "int_mm_split"), torch.float64), a.double() @ w.double().T)


def test_native_panels_worked_example():
    weight = torch.arange(15, dtype=torch.int8).reshape(3, 5)  # [O=3, K=5]
    panels, sums = native.pack(weight)
    assert panels.shape == (1, 2, 64, 4) and panels.dtype == torch.int8
    assert panels[0, 1, 2, 0].item() == weight[2, 4].item() == 14 and panels[0, 1, 2, 1].item() == 0
    assert panels[0, 0, 1].tolist() == weight[1, :4].tolist() and not panels[0, :, 3:].any()
    assert sums.tolist() == (128 * weight.sum(1)).tolist()
    codes = native.codes(torch.tensor([[-127.0, 0.0, 127.0, 5.0, 1.0]]))  # q + 128, padded with 128 to 8 columns
    assert codes.dtype == torch.uint8 and codes.tolist() == [[1, 128, 255, 133, 129, 128, 128, 128]]


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
def test_native_kernels_reject_what_does_not_fit():
    panels, sums = native.pack(torch.ones(70, 8, dtype=torch.int8))
    ones = torch.ones(2, 1), torch.ones(70)
    with pytest.raises(ValueError, match="do not fit"):
        native.linear(torch.zeros(2, 12, dtype=torch.uint8), panels, sums, *ones)
    with pytest.raises(ValueError, match="do not fit"):
        native.linear(torch.zeros(2, 8, dtype=torch.int8), panels, sums, *ones)
    with pytest.raises(ValueError, match="do not fit"):
        native.linear(torch.zeros(2, 8, dtype=torch.uint8), panels, sums, torch.ones(3, 1), torch.ones(70))
    with pytest.raises(ValueError, match="float32"):
        native.quantize(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32"):
        native.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


def test_every_code_times_the_extreme_weights_is_exact_on_every_build_and_a_weight_of_minus_128_is_refused():
    """Each code (0 .. 255, the integers -128 .. 127) against weights of +-127 in every lane: the avx2 build's
    sign trick (|q| times the weight signed by q) at its bounds, for 64 rows at once and for each row alone (a full
    panel of 64 outputs and a partial one: the one-row pass and the passes of 16 outputs); -128, whose sign cannot
    move, is refused at packing."""
    codes = torch.arange(256, dtype=torch.uint8).view(64, 4)  # [N, 4]: every code once
    signs = torch.tensor([[1, -1, 1, -1], [-1, -1, -1, -1], [1, 1, 1, 1]], dtype=torch.int8)
    w = (127 * signs).repeat(23, 1)  # [69, 4]: a panel of 64 outputs and one of 5
    want = ((codes.double() - 128) @ w.double().T).float()  # [N, 69]
    for isa in native.host_isas():
        with native.using(isa):
            packed, ones = native.pack(w), torch.ones(w.shape[0])
            assert torch.equal(native.linear(codes, *packed, torch.ones(64, 1), ones), want), isa
            for row in range(64):
                alone = native.linear(codes[row : row + 1], *packed, torch.ones(1, 1), ones)
                assert torch.equal(alone, want[row : row + 1]), (isa, row)
    with pytest.raises(ValueError, match="-128"):
        native.pack(torch.full((2, 4), -128, dtype=torch.int8))


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70), inner=st.integers(1, 300), outputs=st.integers(1, 150), seed=st.integers(0, 2**16),
    log_scale=st.floats(-30, 30), bias=st.booleans(),
)
def test_native_kernels_give_the_torch_paths_bits(rows, inner, outputs, seed, log_scale, bias):
    """Quantization, the scaled int8 product and RMSNorm in C: the float32 bits of the torch code they replace, for
    any shape (inner sizes not a multiple of 4, partial panels, rows past a micro-kernel's 6) and magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=generator) * 2.0**log_scale  # [N, K]
    x[0, : inner // 2] *= 1000.0  # an outlier block
    if rows > 2:
        x[2] = 0.0  # a zero row takes scale 1
    q, scale = quantize_rows(x)
    codes, native_scale = native.quantize(x)
    assert torch.equal(codes, activation_codes(q, "native")) and torch.equal(native_scale, scale)
    w = torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator)
    w_scale = torch.rand(outputs, generator=generator) * 2.0**log_scale
    b = torch.randn(outputs, generator=generator) if bias else None
    want = (q.double() @ w.double().T).float().mul_(scale).mul_(w_scale)  # [N, O]
    want = want if b is None else want.add_(b)
    assert torch.equal(native.linear(codes, *native.pack(w), scale, w_scale, b), want)
    norm_weight = torch.randn(inner, generator=generator)
    assert torch.equal(native.rms_norm(x, norm_weight, 1e-6), exact_rms_norm(x, norm_weight, 1e-6))
    three_d = x.reshape(1, rows, inner)
    assert torch.equal(native.rms_norm(three_d, norm_weight, 1e-5), exact_rms_norm(three_d, norm_weight, 1e-5))


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 2**16), log_scale=st.floats(-20, 20)
)
def test_native_attention_arithmetic_gives_the_torch_paths_bits(shape, seed, log_scale):
    """The attention's 15-bit quantization (plain and packed) and ``2**t`` in C: the bits of the torch code."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2.0**log_scale
    t = -torch.rand(shape, generator=generator) * 2.0 ** (log_scale / 3)
    t.view(-1)[0] = float("-inf")  # a masked score
    q, scale = native.quantize_wide(x, QKV_LEVELS)
    packed, native_exp2 = pack(x), exp2_nonpositive(t.clone())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        want_q, want_scale = quantize_rows(x, QKV_LEVELS)
        want_packed, want_exp2 = pack(x), exp2_nonpositive(t.clone())
    assert torch.equal(q, want_q.double()) and torch.equal(scale, want_scale.double())
    assert torch.equal(packed, want_packed) and torch.equal(native_exp2, want_exp2)


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 3), queries=st.integers(1, 80),
    extra=st.integers(0, 40), size=st.sampled_from([1, 5, 8, 40, 64, 128]), seed=st.integers(0, 2**16),
)
def test_native_attention_gives_the_torch_paths_bits(batch, kv_heads, group, queries, extra, size, seed):
    """The exact attention in C calls: the bits of the torch path, for keys and values read in place from a larger
    packed cache, GQA groups, any visibility (a query that sees nothing included), and forwards of more queries than
    one block (a prefill: a call per block of queries over the keys it can see)."""
    generator = torch.Generator().manual_seed(seed)
    heads, length = kv_heads * group, queries + extra
    query = torch.randn(batch, heads, queries, size, generator=generator).transpose(1, 2).contiguous().transpose(1, 2)
    storage = torch.stack([pack(torch.randn(batch, kv_heads, length + 7, size, generator=generator)) for _ in "kv"])
    key, value = storage[0, :, :, :length], storage[1, :, :, :length]  # [B, Hk, L, W] int16, strided
    visible = torch.rand(batch, 1, queries, length, generator=generator) < 0.7
    visible[0, 0, 0] = False
    visible[-1, :, queries // 2 + 1 :] = False  # the last queries see nothing (a ragged verification's unscored drafts)
    visible[-1, :, :, : extra // 2] = False  # nor the first keys (a short row's padding beside a long one)
    got = exact_attention(query, key, value, visible, scaling=size**-0.5)
    if queries <= QUERY_CHUNK:
        alone = native.attention(query, key, value, visible, size**-0.5, QKV_LEVELS, EXP2_COEFFICIENTS)
        assert alone is not None and torch.equal(alone, got)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        want = exact_attention(query, key, value, visible, scaling=size**-0.5)
    assert got.shape == (batch, queries, heads, size) and torch.equal(got, want)
    assert not got[0, 0].any()


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
@pytest.mark.parametrize("size", [32, 250, 256])
def test_native_attention_at_its_integer_bounds(size):
    """Queries and keys all at +-(2**15 - 1) in heads of up to 256 values: the largest int32 sums the C kernel's
    split products reach (256 * 32767 * D < 2**31) still give the torch path's bits."""
    generator = torch.Generator().manual_seed(size)
    signs = torch.randint(0, 2, (1, 2, 3, size), generator=generator) * 2.0 - 1.0  # [B, H, Q, D] of +-1
    query, keys = signs.clone(), signs[:, :1].expand(1, 1, 3, size).contiguous()
    query[:, :, 1], keys[:, :, 1] = -1.0, 1.0  # the query's high half at -128 throughout: hi . K = -128 * 32767 * D
    query[:, :, 2], keys[:, :, 2] = 1.0, 1.0  # its low half at 255 throughout: lo . K = 255 * 32767 * D
    key, value = pack(keys), pack(-keys)  # [1, 1, 3, W]
    visible = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    got = native.attention(query, key, value, visible, size**-0.5, QKV_LEVELS, EXP2_COEFFICIENTS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        want = exact_attention(query, key, value, visible, scaling=size**-0.5)
    assert got is not None and torch.equal(got, want)


def test_packed_keys_hold_their_integers_and_scale():
    """The int16 cache layout of the docstring example: 2 bytes a value, the float32 scale's bits in the parities of
    the first 32 integers (one moved a step to carry its bit), read back by the torch path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        torch_packed = pack(torch.tensor([[0.5, -1.0, 0.25]]))
        integers, scale = attention._unpacked(torch_packed, 3)
    packed = pack(torch.tensor([[0.5, -1.0, 0.25]]))
    assert packed.dtype == torch.int16 and torch.equal(packed, torch_packed)
    want = [16384, -32766, 8192] + [0] * 29
    for bit in (8, 27, 28, 29):
        want[bit] = 1
    assert packed[0].tolist() == want
    assert integers.tolist() == [[16384.0, -32766.0, 8192.0]]
    assert scale.item() == torch.tensor(1.0 / 32767).item()
    assert pack(torch.randn(2, 3, 5, 128)).shape == (2, 3, 5, 128)


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([1, 5, 31, 32, 64, 128]), seed=st.integers(0, 2**16), log_scale=st.floats(-30, 30))
def test_packed_integers_stay_within_one_of_the_values_and_carry_the_scale(size, seed, log_scale):
    """Every packed integer is within 1 of ``x / scale`` (within 1/2 past the 32 that carry the scale's bits), inside
    +-32767, and the parities give back the scale exactly, with the native kernels or without."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, size, generator=generator) * 2.0**log_scale
    x[0] = 0.0
    x[1, 0] = -x[1].abs().max() * 2  # a head whose extreme value is negative
    packed = pack(x)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        assert torch.equal(pack(x), packed)
        integers, scale = attention._unpacked(packed, size)
    _, want_scale = quantize_rows(x, QKV_LEVELS)
    assert torch.equal(scale, want_scale.double())
    error = (integers - x.double() / scale).abs()  # [4, D]; x / scale rounds in float32 first (2**-9 at 32767)
    assert error.max() <= 1.0 + 2**-8 and (error[:, 32:] <= 0.5 + 2**-8).all()
    assert integers.abs().max() <= QKV_LEVELS


def test_a_machine_whose_compiler_fails_keeps_the_same_bits(tmp_path):
    """With no C compiler the native kernels are not built: one log line, another exact kernel, the same output."""
    script = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from batchspec.exact.integer.product import product_kernel\n"
        "from batchspec.exact.integer.linear import Int8Linear\n"
        "torch.manual_seed(0)\n"
        "layer = Int8Linear(torch.nn.Linear(1030, 1100))\n"
        "torch.save({'kernel': product_kernel(torch.float32), 'y': layer(torch.randn(9, 1030))}, sys.argv[1])\n"
    )
    env = dict(os.environ, BATCHSPEC_CACHE=str(tmp_path), CC=str(tmp_path / "missing-cc"))
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    path = tmp_path / "y.pt"
    run = subprocess.run([sys.executable, "-c", script, path], env=env, check=True, timeout=120, capture_output=True)
    fallback = torch.load(path)
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(1030, 1100))
    assert fallback["kernel"] != "native"
    assert torch.equal(fallback["y"], layer(torch.randn(9, 1030)))
    if native.available():
        assert layer.weight.kernel == "native" and "int8 kernels did not build" in run.stderr.decode()


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
def test_each_fallback_says_once_what_it_fell_to(caplog, bundles):
    """Heads larger than the native kernel takes run the attention in torch, an integer model the fused forward cannot
    run (here one computed in float64) runs through transformers' forward, and a build whose product fails its
    exactness check hands the products to another kernel: each says so in one log line, once."""
    from batchspec.exact.integer.forward import integer_forward

    size = native.MAX_HEAD_SIZE + 16
    query = torch.randn(1, 1, 2, size, generator=torch.Generator().manual_seed(1))
    key = pack(torch.randn(1, 1, 2, size, generator=torch.Generator().manual_seed(2)))
    visible = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with caplog.at_level("INFO"):
        for _ in range(2):
            exact_attention(query, key, key, visible, scaling=size**-0.5)
        assert integer_forward(quantize_model(copy.deepcopy(bundles["llama"].target))) is None  # float64
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(product, "_native_exact", lambda isa: False)
            assert product.exact_kernels(torch.float32)[0] != "native"
    assert caplog.text.count(f"exact attention over heads of {size} values runs in torch") == 1
    assert "runs its integer layers through transformers' forward" in caplog.text and "float64" in caplog.text
    assert f"the {native.isa()} build's int8 product did not give the exact sums" in caplog.text


def test_exact_attention_is_close_to_softmax_attention():
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    visible = torch.ones(2, 1, 3, 9, dtype=torch.bool).tril(diagonal=6)
    visible[1, :, :, :2] = False  # left padding of row 1
    got = exact_attention(query, key, value, visible, scaling=0.25)
    expanded = [t.repeat_interleave(2, dim=1) for t in (key, value)]
    want = torch.nn.functional.scaled_dot_product_attention(
        query, *expanded, attn_mask=visible, scale=0.25
    ).transpose(1, 2)
    assert got.shape == want.shape == (2, 3, 4, 16)
    assert (got - want).abs().max().item() < 2e-3


def test_a_query_that_sees_nothing_outputs_zeros():
    query, key, value = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    visible = torch.tensor([[[[False] * 4, [True] * 4]]])
    out = exact_attention(query, key, value, visible, scaling=1.0)
    assert torch.equal(out[0, 0], torch.zeros(2, 8)) and out[0, 1].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ the model


def test_float32_layers_take_the_two_fastest_exact_kernels(quantized_float32):
    kernels = {m.weight.kernel for m in quantized_float32["llama"].modules() if isinstance(m, Int8Linear)}
    assert kernels == set(exact_kernels(torch.float32)[:2])
    assert product_kernel(torch.float32) == exact_kernels(torch.float32)[0]
    assert product_kernel(torch.float64) in ("int_mm", "int_mm_split")


def test_quantize_swaps_every_layer_and_stays_close(bundles):
    bundle = bundles["llama"]
    model = quantize_model(copy.deepcopy(bundle.target))
    assert quantization(model) == "int8" and quantization(bundle.target) == "none"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = torch.tensor([bundle.probe[0][0]])
    with torch.no_grad():
        dense, exact = bundle.target(ids).logits, model(ids).logits
    assert (exact - dense).abs().max().item() < 0.1 * dense.abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_smoothing_leaves_the_float_model_unchanged(kind, bundles):
    """Smoothing moves scale between activations and weights: the float64 model computes the same logits."""
    model = copy.deepcopy(bundles[kind].target)
    ids = torch.tensor([bundles[kind].probe[0][0]])
    layers = decoder_layers(model)
    with torch.no_grad():
        before = model(ids).logits
        peaks = calibration_peaks(model, calibration_ids(None, model.config.vocab_size))
        for layer in layers:
            smooth_layer(layer, peaks[layer])
        after = model(ids).logits
    assert len(layers) == model.config.num_hidden_layers
    assert torch.allclose(after, before, rtol=1e-9, atol=1e-9)
    for layer, original in zip(layers, bundles[kind].target.model.layers, strict=True):
        assert not torch.equal(layer.input_layernorm.weight, original.input_layernorm.weight)
        assert not torch.equal(layer.mlp.up_proj.weight, original.mlp.up_proj.weight)


def test_check_quantize_names_the_choices():
    assert check_quantize("int8") == "int8" and check_quantize("int4") == "int4"
    with pytest.raises(ValueError, match="auto, none, int8, int4"):
        check_quantize("int2")


def test_a_bfloat16_model_quantizes_to_the_bits_of_its_float32_widening(bundles):
    """A checkpoint held in bfloat16 is computed in float32 as it is quantized: the same bits as widening it first."""
    held = copy.deepcopy(bundles["llama"].target).to(torch.bfloat16)
    widened = copy.deepcopy(held).float()
    ids = torch.tensor([bundles["llama"].probe[0][0]])
    with torch.no_grad():
        logits = [quantize_model(model)(ids).logits for model in (held, widened)]
    assert logits[0].dtype == torch.float32
    assert torch.equal(logits[0], logits[1])


def test_quantize_refuses_what_it_cannot_make_exact(bundles):
    with pytest.raises(ValueError, match="float32"):
        quantize_model(copy.deepcopy(bundles["llama"].target).to(torch.float64), width="int4")
    gelu = tiny_models.build_llama(seed=5, hidden_act="gelu")
    with pytest.raises(ValueError, match="an MLP activation among"):
        quantize_model(gelu)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_row_is_bit_identical_to_itself_alone(kind, dtype, quantized, quantized_float32, data):
    """The property: rows of different lengths, left-padded, in forwards of 1..5 new tokens, give each row exactly
    the logits it gets alone, one token at a time; in float64, and in float32 on both product kernels."""
    model = quantized[kind][0] if dtype == "float64" else quantized_float32[kind]
    batch = data.draw(st.integers(1, 4), label="batch")
    lengths = data.draw(st.lists(st.integers(2, 24), min_size=batch, max_size=batch), label="lengths")
    prefix = [data.draw(st.integers(1, n - 1), label="prefix") for n in lengths]
    longest_tail = max(n - p for n, p in zip(lengths, prefix, strict=True))
    steps = []
    while sum(steps) < longest_tail:
        steps.append(data.draw(st.integers(1, 5), label="step"))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    batched = ragged_forwards(model, rows, prefix, steps)
    for row, got in zip(rows, batched, strict=True):
        assert torch.equal(got, alone_one_token_at_a_time(model, row))


# ------------------------------------------------------------------------------------------------ through batchspec


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "method, proposer, k",
    [("eqspec", "draft", 3), ("exspec", "draft", 2), ("eqspec", "ngram", 4), ("eqspec", "hybrid", "auto"),
     ("exspec", "hybrid", 3), ("autoregressive", None, 1)],
)
def test_batched_output_equals_the_quantized_models_own(kind, method, proposer, k, quantized, bs, reference):
    target, draft, bundle = quantized[kind]
    prompts = [prompt for prompt, _ in bundle.probe[:6]]
    result = bs.generate(
        target, draft, prompts, method=method, proposer=proposer, batch_size=4, max_new_tokens=24,
        num_draft_tokens=k, eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id, check_invariants=True,
    )
    assert result.sequences == [reference(target, prompt, 24, bundle.eos_id) for prompt in prompts]


@pytest.mark.parametrize("method, proposer", [("eqspec", "draft"), ("exspec", "hybrid"), ("eqspec", "ngram")])
def test_seeded_samples_do_not_depend_on_the_batch_or_k(method, proposer, quantized, bs):
    """Each prompt decoded alone (batch size 1, k = 3) and in batches with other k draws the same tokens."""
    target, draft, bundle = quantized["qwen2"]
    prompts = [prompt + prompt[:4] + prompt for prompt, _ in bundle.probe[:5]]  # repeats: lookups find matches
    common = {"method": method, "proposer": proposer, "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95,
              "seed": 7, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id, "check_invariants": True}
    alone = bs.generate(target, draft, prompts, batch_size=1, num_draft_tokens=3, **common)
    assert alone.stats.draft_tokens_proposed > 0
    for batch_size, k in [(5, 2), (3, 5), (4, "auto")]:
        batched = bs.generate(target, draft, prompts, batch_size=batch_size, num_draft_tokens=k, **common)
        assert batched.sequences == alone.sequences


@pytest.mark.parametrize("method, proposer", [("eqspec", "draft"), ("exspec", "hybrid")])
def test_sampled_pairs_follow_the_quantized_targets_distribution(method, proposer):
    """Chi-square of the first two sampled tokens against the int8 target's own joint distribution."""
    shape = {"vocab_size": 10, "initializer_range": 0.2, "hidden_size": 32, "intermediate_size": 64}
    target = tiny_models.build_llama(seed=11, **shape)
    draft = quantize_model(tiny_models.perturbed_copy(target, 0.2, seed=12))
    target = quantize_model(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1]
    sampling = {"temperature": 1.0, "top_k": 8}
    result = batchspec.generate(
        target, draft, [prompt] * 3000, method=method, proposer=proposer, batch_size=250, max_new_tokens=3,
        num_draft_tokens=2, eos_token_id=[], seed=26, **sampling,
    )
    assert 0.05 < result.stats.acceptance_rate < 0.95
    joint = exact_joint(target, prompt, SamplingParams(**sampling))
    assert joint_pvalue([s[:2] for s in result.sequences], joint) > 1e-3


def test_a_shared_quantization_is_each_threads_own():
    """q, k and v of one layer share their input's quantization; a forward of another thread on the same model (two
    servers of one process) between them neither takes those rows nor lets them go: the third reader of this thread
    still gets the rows its first made. On one state for all threads the other thread's readers let them go, and a
    race between the check and the read gave ``None[1]`` (a served chat's 500)."""
    import threading

    shared = linear.SharedQuantization(readers=3)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    first = shared(x)
    other = threading.Thread(target=lambda: [shared(y) for _ in range(3)])
    other.start()
    other.join()
    assert shared(x) is first and shared(x) is first
    assert shared(x) is not first, "after its readers, the next call quantizes afresh"
