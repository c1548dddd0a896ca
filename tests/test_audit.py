"""The audit's near-tie rule on hand-built references: the margin is judged in steps of the models' dtype."""

from __future__ import annotations

import math

import pytest
import torch

from batchspec.bench.audit import NEAR_TIE_ULPS, NearTieRule, find_divergences, float_dtype, spacing
from batchspec.bench.reference import Reference

EXPECTED = [5, 6, 7]
DEFAULT_RULE = NearTieRule()


def reference_with(top_logit: float, margin: float) -> Reference:
    """One prompt whose reference is ``EXPECTED``; at position 1 its top logit and top-2 margin are as given."""
    return Reference(
        key="hand-built", sequences=[list(EXPECTED)], margins=[[9.0, margin, 9.0]], top_logits=[[30.0, top_logit, 30.0]]
    )


def judge(dtype: str, top_logit: float, margin: float, rule: NearTieRule = DEFAULT_RULE):
    (divergence,) = find_divergences([[5, 8, 7]], reference_with(top_logit, margin), rule, float_dtype(dtype))
    assert (divergence.prompt, divergence.position, divergence.expected, divergence.got) == (0, 1, 6, 8)
    assert divergence.top_logit == top_logit and divergence.margin == margin
    return divergence


@pytest.mark.parametrize(
    ("dtype", "top_logit", "margin", "margin_ulps", "near_tie"),
    [
        ("bfloat16", 20.0, 0.125, 1.0, True),  # one bfloat16 step at magnitude 16..32
        ("bfloat16", 20.0, 0.25, 2.0, True),
        ("bfloat16", 20.0, 0.5, 4.0, True),  # exactly NEAR_TIE_ULPS steps
        ("bfloat16", 20.0, 0.625, 5.0, False),
        ("bfloat16", -20.0, 0.125, 1.0, True),  # the magnitude counts, not the sign
        ("bfloat16", 16.0, 0.5, 4.0, True),  # a power of two starts the wider binade
        ("bfloat16", 15.5, 0.5, 8.0, False),  # 8..16: steps of 0.0625
        ("bfloat16", 40.0, 1.0, 4.0, True),  # 32..64: steps of 0.25
        ("bfloat16", 20.0, 0.0, 0.0, True),  # an exact tie
        ("bfloat16", 0.0, 0.0, 0.0, True),
        ("float16", 20.0, 0.125, 8.0, False),  # float16 steps of 2**-6 there
        ("float32", 20.0, 0.125, 65536.0, False),  # the same margin is 2**16 float32 steps
        ("float32", 20.0, 4 * 2.0**-19, 4.0, True),
        ("float32", 20.0, 5 * 2.0**-19, 5.0, False),
        ("float32", 20.0, 0.0, 0.0, True),
    ],
)
def test_near_tie_follows_the_dtype(dtype, top_logit, margin, margin_ulps, near_tie):
    divergence = judge(dtype, top_logit, margin)
    assert divergence.margin_ulps == margin_ulps
    assert divergence.near_tie is near_tie


def test_the_multiple_can_be_changed():
    assert judge("bfloat16", 20.0, 0.625).near_tie is False
    assert judge("bfloat16", 20.0, 0.625, NearTieRule(ulps=5)).near_tie is True
    assert judge("bfloat16", 20.0, 0.125, NearTieRule(ulps=0.5)).near_tie is False
    assert judge("bfloat16", 20.0, 0.0, NearTieRule(ulps=0)).near_tie is True


def test_a_method_going_on_after_the_reference_ended_fails():
    reference = reference_with(20.0, 0.0)
    (longer,) = find_divergences([[*EXPECTED, 4]], reference, NearTieRule(ulps=1e30), torch.bfloat16)
    assert (longer.position, longer.expected, longer.got, longer.top_logit) == (3, None, 4, None)
    assert math.isinf(longer.margin) and math.isinf(longer.margin_ulps) and not longer.near_tie
    (shorter,) = find_divergences([[5]], reference_with(20.0, 0.125), NearTieRule(), torch.bfloat16)
    assert (shorter.position, shorter.expected, shorter.got, shorter.near_tie) == (1, 6, None, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.75, 1.0, 3.0, 16.0, 20.0, 31.9, 32.0, 100.0, -20.0, -1.0])
def test_spacing_is_the_distance_to_the_next_number_away_from_zero(dtype, value):
    x = torch.tensor(value, dtype=dtype)
    outward = torch.nextafter(x, torch.tensor(math.copysign(math.inf, value), dtype=dtype))
    assert spacing(float(x), dtype) == abs(float(outward) - float(x))


def test_the_default_multiple_and_rule_validation():
    assert NEAR_TIE_ULPS == NearTieRule().ulps == 4
    for bad in (-1, math.inf, math.nan, True, "4"):
        with pytest.raises(ValueError, match="near-tie multiple must be a finite number >= 0"):
            NearTieRule(ulps=bad)
    for name in ("int64", "bool", "float128x", "auto"):
        with pytest.raises(ValueError, match="is not a floating-point dtype"):
            float_dtype(name)
    assert float_dtype("bfloat16") is torch.bfloat16
