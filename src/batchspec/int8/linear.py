"""The int8 linear layer: int8 weights with one scale per output channel, activations quantized per token.

For one token ``x`` (``[K]``) and output channel ``o``: ``y[o] = (acc[o] * sx) * sw[o] + b[o]`` with
``acc = round(x / sx) . W8[o]`` summed exactly in int32, ``sx = max|x| / 127`` and ``sw[o] = max|W[o]| / 127``.
Every step is elementwise or an exact integer sum (see :mod:`batchspec.int8.arithmetic`), so a token's
output does not depend on the other tokens or rows of the call, nor on how the integer kernel blocks the product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchspec.int8.arithmetic import int_matmul, quantize_rows, silu_, weight_factors


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [O, K], scale [O])`` of a float weight ``[O, K]``: per output channel, in the weight's dtype."""
    q, scale = quantize_rows(weight.detach())
    return q.to(torch.int8).contiguous(), scale[:, 0].contiguous()


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (``factors``: ``[K, O]`` as :func:`weight_factors` lays it out for this CPU;
    ``scale`` ``[O]``) and per-token int8 activations.

    The weight is kept ``[K, O]`` (the transpose of ``nn.Linear``'s): oneDNN's int8 product read it 1.2-1.8x faster
    that way for 2 to 64 rows, streaming 40 different 1536 x 8960 weights from memory on an AMD EPYC Zen 5 (8 rows:
    0.54 against 0.95 ms), and 1.4x slower for one row (0.50 against 0.36 ms)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_weight(linear.weight)
        self.factors = weight_factors(qweight.T)  # [K, O] each
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.quantizer: SharedQuantization | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        return self.apply_to(quantize_activations(x) if self.quantizer is None else self.quantizer(x))

    def apply_to(self, rows: QuantizedRows) -> torch.Tensor:
        """The layer's output for activations already quantized (several layers may share one quantization)."""
        acc = int_matmul(rows.values, self.factors)  # [N, O] int32, exact
        y = (acc * rows.scale).mul_(self.scale)  # [N, O] in the activations' dtype (int32 acc cast, then scaled)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*rows.shape, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized per token: ``values`` int8 ``[N, K]``, ``scale`` ``[N, 1]``, the float ``dtype`` and
    the leading ``shape`` (``[...]``) they had."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]


def quantize_activations(x: torch.Tensor) -> QuantizedRows:
    """Quantize ``x`` (``[..., K]``) per token to int8."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))  # [N, K], [N, 1]
    return QuantizedRows(q.to(torch.int8), scale, x.dtype, tuple(x.shape[:-1]))


class SharedQuantization:
    """One quantization for ``readers`` layers called one after another on the same input tensor (an attention's q,
    k and v projections read one ``hidden_states``): the rows are reused while the input is that same tensor object,
    which is held (so no other tensor can take its place in memory) until the last reader has had them."""

    def __init__(self, readers: int) -> None:
        self.readers = readers
        self._last: tuple[torch.Tensor, QuantizedRows] | None = None
        self._served = 0

    def __call__(self, x: torch.Tensor) -> QuantizedRows:
        if self._last is None or self._last[0] is not x:
            self._last, self._served = (x, quantize_activations(x)), 0
        rows = self._last[1]
        self._served += 1
        if self._served == self.readers:
            self._last = None
        return rows


class Int8MLP(torch.nn.Module):
    """The gated SiLU MLP of Llama-like models on :class:`Int8Linear` layers: ``down(silu(gate(x)) * up(x))``,
    with ``x`` quantized once for gate and up and the activation computed in place."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Int8Linear(mlp.gate_proj), Int8Linear(mlp.up_proj)
        self.down_proj = Int8Linear(mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        rows = quantize_activations(x)
        hidden = silu_(self.gate_proj.apply_to(rows))  # [..., F]
        return self.down_proj(hidden.mul_(self.up_proj.apply_to(rows)))
