"""The rotary embedding of the exact model: a table of every position's cos and sin, the same bits on every CPU.

transformers computes a forward's ``cos``/``sin`` with torch's vector ``cos`` and ``sin``, and the frequencies they
turn at (``inv_freq = 1 / base ** (2 i / D)``) with torch's vector ``pow``; each of the three rounds its last bit by
the instruction set torch dispatches to, and ``cos``/``sin`` also by where a value sits in the tensor and by the thread
count. Measured: for Qwen's base 10**6 and head size 128, torch's AVX2 and AVX-512 ``pow`` round frequency 37 the
other way from the exact value (its default, scalar dispatch rounds it right), so the tables, and the int8 model's
logits, had other bits on a CPU without AVX2. :class:`RotaryTable` holds instead:

* the frequencies from the model's own rope function, its every float32 ``pow`` correctly rounded
  (:func:`correctly_rounded_frequencies`; the function's other operations are single IEEE roundings, the same
  everywhere);
* for position ``p`` and frequency ``f``, the float32 angle ``f * p`` as transformers rounds it, its cosine and sine
  correctly rounded (:func:`correctly_rounded`), times the module's ``attention_scaling``.

A table holds the positions :func:`batchspec.families.positions_of` gives and refuses a position past them. Where the
rope's ``partial_rotary_factor`` is below 1 its rows are as narrow as the part of a head that turns
(``2 * len(inv_freq)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mpmath
import numpy
import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)


class RotaryTable(torch.nn.Module):
    """The model's rotary embedding ``rotary``, computed once for ``positions`` positions and then looked up, in
    ``dtype`` (see the module docstring). A module with a table per layer type (Gemma 3's: ``layer_types``, each
    type's ``{type}_inv_freq`` and ``{type}_attention_scaling``, called with the type) gets one table per type, each
    made as a single table is; :meth:`forward` then takes the type too."""

    def __init__(self, rotary: torch.nn.Module, positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_types = tuple(getattr(rotary, "layer_types", None) or ())
        for layer_type in self.layer_types or (None,):
            prefix = "" if layer_type is None else f"{layer_type}_"
            frequencies = correctly_rounded_frequencies(rotary, layer_type)  # [D / 2]
            angles = torch.arange(positions, dtype=torch.float32)[:, None] * frequencies  # [P, D / 2]
            angles = torch.cat([angles, angles], dim=-1)  # [P, D]
            scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
            cos, sin = (correctly_rounded(angles, f).mul_(scaling).to(dtype) for f in ("cos", "sin"))  # [P, D] each
            device = getattr(rotary, f"{prefix}inv_freq").device
            self.register_buffer(f"{prefix}cos", cos.to(device), persistent=False)
            self.register_buffer(f"{prefix}sin", sin.to(device), persistent=False)

    def cos_tables(self) -> list[torch.Tensor]:
        """Every cosine table held, ``[P, R]`` each: the model's one, or one per layer type."""
        return [getattr(self, "cos" if kind is None else f"{kind}_cos") for kind in self.layer_types or (None,)]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = "" if layer_type is None else f"{layer_type}_"
        cos, sin = getattr(self, f"{prefix}cos"), getattr(self, f"{prefix}sin")  # [P, R] each
        if position_ids.numel() and int(position_ids.max()) >= cos.shape[0]:
            raise ValueError(f"position {int(position_ids.max())} is past the {cos.shape[0]} positions this "
                             "model's exact rotary embedding holds (batchspec.families.positions_of)")
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)  # [B, S, R] each: R of a head's D turn


def correctly_rounded_frequencies(rotary: torch.nn.Module, layer_type: str | None = None) -> torch.Tensor:
    """``rotary.inv_freq`` (float32 ``[D / 2]``; of a module with a table per layer type, ``layer_type``'s) as its own
    rope function computes it from the model's config, with
    every float32 ``pow`` in it correctly rounded (:class:`CorrectlyRoundedPow`), then rounded as the module's own
    values were where they were rounded further (:func:`_held_precision`: a model cast to bfloat16 holds its
    frequencies so, even once widened again, and its forward turns at those). A module without a config and rope
    type transformers knows keeps its own ``inv_freq``, with one log line; a recomputation that is not within a
    rounding of the module's own raises ValueError (the module is not what its config says)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    held = getattr(rotary, f"{prefix}inv_freq").detach().to("cpu")  # [D / 2]
    function = _rope_function(rotary, layer_type)
    if function is None:
        logger.warning("batchspec: %s has no rope function transformers knows; its inv_freq is kept as torch's pow "
                       "rounded it on this CPU", type(rotary).__name__)
        return held.float()
    typed = {} if layer_type is None else {"layer_type": layer_type}
    with CorrectlyRoundedPow():
        frequencies = function(rotary.config, **typed)[0].detach().to("cpu", torch.float32)  # [D / 2]
    precision = _held_precision(held)
    frequencies = frequencies.to(precision).float()
    tolerance = max(torch.finfo(precision).eps, 2.0**-20)
    if frequencies.shape != held.shape or not torch.allclose(frequencies, held.float(), rtol=tolerance, atol=0.0):
        raise ValueError(f"{type(rotary).__name__}'s inv_freq is not what its config's rope function gives")
    return frequencies


def _held_precision(held: torch.Tensor) -> torch.dtype:
    """The narrowest of bfloat16, float16 and float32 that holds every value of ``held`` exactly (its dtype's, or a
    narrower one its values were rounded to before it was widened); float32 for wider values."""
    exact = (dtype for dtype in (torch.bfloat16, torch.float16) if torch.equal(held.to(dtype).to(held.dtype), held))
    return next(exact, torch.float32)


def _rope_function(rotary: torch.nn.Module, layer_type: str | None = None) -> Callable | None:
    """The function transformers built ``rotary.inv_freq`` with (its class's default one, or the rope type's; of a
    module with a table per layer type, ``layer_type``'s)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type)
    if getattr(rotary, "config", None) is None:
        return None
    if rope_type == "default":
        return getattr(type(rotary), "compute_default_rope_parameters", None)
    return ROPE_INIT_FUNCTIONS.get(rope_type)


_POWERS = (torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__)


class CorrectlyRoundedPow(TorchFunctionMode):
    """Inside the block, every torch ``pow`` with a float32 result gives each element correctly rounded
    (:func:`pow_rounded`) instead of torch's vector ``pow`` (for small tables: each element takes an mpmath call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func not in _POWERS or not isinstance(result, torch.Tensor) or result.dtype != torch.float32:
            return result
        base, exponent = (args[1], args[0]) if func is torch.Tensor.__rpow__ else (args[0], args[1])
        return pow_rounded(base, exponent).to(result.device)


def pow_rounded(base: torch.Tensor | float, exponent: torch.Tensor | float) -> torch.Tensor:
    """``base ** exponent`` (broadcast, each operand rounded to float32 first, as torch's float32 ``pow`` takes
    them), each element the float32 nearest the exact power; a non-positive or non-finite base, or a non-finite
    exponent, gets torch's value (IEEE's special cases, the same everywhere)."""
    base, exponent = (torch.as_tensor(t, dtype=torch.float32).cpu() for t in (base, exponent))
    base, exponent = torch.broadcast_tensors(base, exponent)
    out = torch.pow(base, exponent).contiguous()  # torch's values, kept only for the special cases
    flat_base, flat_exponent, flat = base.reshape(-1).tolist(), exponent.reshape(-1).tolist(), out.view(-1)
    for i, (b, e) in enumerate(zip(flat_base, flat_exponent, strict=True)):
        if 0.0 < b < float("inf") and abs(e) < float("inf"):
            with mpmath.workprec(PRECISION):
                flat[i] = float32_nearest(mpmath.power(mpmath.mpf(b), mpmath.mpf(e)))
    return out


PRECISION = 100  # bits of the mpmath values rounded to float32 (25 are needed, plus room to tell a near-tie)


def correctly_rounded(x: torch.Tensor, function: str) -> torch.Tensor:
    """``function`` (``"cos"`` or ``"sin"``) of float32 ``x``, correctly rounded to float32: numpy's float64 value
    rounded, except where it lies within 2**-40 of its size from a float32 rounding boundary (float64's error could
    then decide the rounding), recomputed there with mpmath at :data:`PRECISION` bits.

    numpy's, not torch's: torch's float64 ``cos`` of a large tensor runs MKL's vector library on each of its threads,
    and once in a while the first call in a process is far less accurate on one thread's part. Measured on a 2-core
    Xeon loading the qwen2.5-coder target: in 6 of 30 processes the first call gave the first half of the table's
    angles values up to 6.6e-8 of their size off (125,646 of its 4.2 million cosines one float32 step off, the same
    ones each time), while a second call right after was within an ulp of float64; those loads smoothed with other
    peaks and so held other int8 weights. numpy computes on the calling thread, here at most 1.1e-16 of the value
    off (6,000 seeded cosines and sines against mpmath), far inside the 2**-40 the rounding tolerates."""
    wide = torch.from_numpy(getattr(numpy, function)(x.double().numpy()))  # [...]
    narrow = wide.float()
    step = torch.nextafter(narrow, torch.where(wide >= narrow.double(), torch.inf, -torch.inf)).double()
    boundary = (narrow.double() + step) / 2  # the midpoint between narrow and its neighbour towards wide
    hard = (wide - boundary).abs() <= wide.abs() * 2.0**-40
    for index in hard.nonzero():
        narrow[tuple(index)] = mp_rounded(float(x[tuple(index)]), function)
    return narrow


def mp_rounded(value: float, function: str) -> float:
    """``function`` of the float ``value`` at :data:`PRECISION` bits, rounded to float32 (:func:`float32_nearest`)."""
    with mpmath.workprec(PRECISION):
        return float32_nearest(getattr(mpmath, function)(mpmath.mpf(value)))


def float32_nearest(exact: mpmath.mpf) -> float:
    """The float32 nearest to ``exact`` (ties to even), found by comparing it with the midpoint of its two
    neighbours."""
    low = torch.tensor(float(exact), dtype=torch.float64).float()
    other = torch.nextafter(low, torch.tensor(torch.inf if mpmath.mpf(float(low)) < exact else -torch.inf))
    midpoint = (mpmath.mpf(float(low)) + mpmath.mpf(float(other))) / 2
    nearer_low = abs(exact - mpmath.mpf(float(low))) < abs(exact - mpmath.mpf(float(other)))
    if exact == midpoint:
        nearer_low = int(low.view(torch.int32)) % 2 == 0
    return float(low if nearer_low else other)
