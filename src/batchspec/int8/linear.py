"""The int8 linear layer: int8 weights with one scale per output channel, activations quantized per token.

For one token ``x`` (``[K]``) and output channel ``o``: ``y[o] = (acc[o] * sx) * sw[o] + b[o]`` with
``acc = round(x / sx) . W8[o]`` summed exactly in int32, ``sx = max|x| / 127`` and ``sw[o] = max|W[o]| / 127``.
Every step is elementwise or an exact integer sum (see :mod:`batchspec.int8.arithmetic`), so a token's
output does not depend on the other tokens or rows of the call, nor on how the integer kernel blocks the product.

Nor does a channel's value depend on the other channels of the call, so layers that read one input are one product
over their stacked weights (:func:`stacked`): an attention's q, k and v projections (:class:`SharedProduct`), an
MLP's gate and up projections (:class:`Int8MLP`). One call reads all their weights, with the bits each gives alone.
"""

from __future__ import annotations

import itertools

import torch

from batchspec.int8 import native
from batchspec.int8.arithmetic import quantize_rows, silu_
from batchspec.int8.native import ZERO_POINT
from batchspec.int8.product import PackedWeight, activation_codes, int_product, pack_weight, product_kernel


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [O, K], scale [O])`` of a float weight ``[O, K]``: per output channel, in the weight's dtype."""
    q, scale = quantize_rows(weight.detach())
    return q.to(torch.int8).contiguous(), scale[:, 0].contiguous()


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (``weight``: laid out once for this CPU's exact product, see
    :mod:`batchspec.int8.product`; ``scale`` ``[O]``) and per-token int8 activations."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_weight(linear.weight)
        self.weight: PackedWeight = pack_weight(qweight, product_kernel(linear.weight.dtype, qweight.numel()))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        rows = quantize_activations(x)
        codes = rows.codes(self.weight.kernel)  # [N, K]
        if self.weight.kernel == "vnni":  # the scales and bias applied in the kernel, in the order below
            y = native.linear(codes, *self.weight.tensors, rows.scale, self.scale, self.bias)  # [N, O]
            return y.reshape(*rows.shape, self.out_features)
        acc = int_product(codes, self.weight, rows.dtype)  # [N, O]: the exact int32 sums, in the float dtype
        y = acc.mul_(rows.scale).mul_(self.scale)  # [N, O]
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*rows.shape, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantizedRows:
    """Activations quantized per token: ``scale`` ``[N, 1]``, the float ``dtype`` and the leading ``shape``
    (``[...]``) they had, and the integers in ``[-127, 127]`` as each product kernel takes them (:meth:`codes`, made
    once per kernel). :attr:`values` holds the integers in the float dtype (``[N, K]``)."""

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], inner: int,
                 values: torch.Tensor | None = None, codes: dict[str, torch.Tensor] | None = None) -> None:
        if values is None and not codes:
            raise ValueError("quantized rows need their values or the codes of one kernel")
        self.scale, self.dtype, self.shape, self.inner = scale, dtype, shape, inner
        self._values, self._codes = values, dict(codes or {})

    @property
    def values(self) -> torch.Tensor:
        """The integers in the float dtype, ``[N, K]`` (derived exactly from the ``vnni`` codes when only those
        were made)."""
        if self._values is None:
            self._values = self._codes["vnni"][:, : self.inner].to(self.dtype).sub_(ZERO_POINT)
        return self._values

    def codes(self, kernel: str) -> torch.Tensor:
        """The values as ``kernel`` takes them (:func:`~batchspec.int8.product.activation_codes`)."""
        if kernel not in self._codes:
            self._codes[kernel] = activation_codes(self.values, kernel)
        return self._codes[kernel]


def quantize_activations(x: torch.Tensor) -> QuantizedRows:
    """Quantize ``x`` (``[..., K]``) per token to int8; float32 on a CPU with batchspec's native kernels goes
    straight to the ``vnni`` codes (:func:`~batchspec.int8.native.quantize`, the same bits)."""
    flat = x.reshape(-1, x.shape[-1])  # [N, K]
    if x.dtype == torch.float32 and native.available():
        codes, scale = native.quantize(flat)
        return QuantizedRows(scale, x.dtype, tuple(x.shape[:-1]), x.shape[-1], codes={"vnni": codes})
    q, scale = quantize_rows(flat)  # [N, K], [N, 1]
    return QuantizedRows(scale, x.dtype, tuple(x.shape[:-1]), x.shape[-1], values=q)


def stacked(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One ``nn.Linear`` whose output is the ``linears``' outputs side by side (they share ``in_features``). A layer
    without a bias among ones with biases gets zeros: its ``y + 0`` is ``y``, bit for bit, since an int8 layer's
    ``y`` is never ``-0`` (a zero sum is ``+0``, and the scales are positive)."""
    first = linears[0]
    outputs = sum(layer.out_features for layer in linears)
    merged = torch.nn.Linear(first.in_features, outputs, bias=False, device="meta")
    merged.weight = torch.nn.Parameter(torch.cat([layer.weight.detach() for layer in linears]), requires_grad=False)
    if any(layer.bias is not None for layer in linears):
        biases = [layer.weight.new_zeros(layer.out_features) if layer.bias is None else layer.bias.detach()
                  for layer in linears]
        merged.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
    return merged


class SharedProduct:
    """One :class:`Int8Linear` product for layers called one after another on the same input tensor (an attention's
    q, k and v projections read one ``hidden_states``), each served its slice of the output (:class:`ProductPart`).
    The product runs when the first reader asks; it is reused while the input is that same tensor object, which is
    held (so no other tensor can take its place in memory) until the last reader has had its part.

    Example: q, k, v of 1536, 256 and 256 outputs are one product of 2048; k's part is ``out[..., 1536:1792]``.
    """

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        self.product = Int8Linear(stacked(linears))
        ends = list(itertools.accumulate(layer.out_features for layer in linears))
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._served = 0

    def part(self, x: torch.Tensor, reader: int) -> torch.Tensor:  # [..., K] -> [..., O_reader]
        if self._last is None or self._last[0] is not x:
            self._last, self._served = (x, self.product(x)), 0
        out = self._last[1]
        self._served += 1
        if self._served == len(self.bounds):
            self._last = None
        start, end = self.bounds[reader]
        return out[..., start:end]


class ProductPart(torch.nn.Module):
    """Layer ``reader`` of a :class:`SharedProduct`, in the model where its ``nn.Linear`` was (the shared product is
    each part's submodule ``product``, so ``model.modules()`` lists it once)."""

    def __init__(self, shared: SharedProduct, reader: int) -> None:
        super().__init__()
        self.shared, self.reader, self.product = shared, reader, shared.product
        start, end = shared.bounds[reader]
        self.in_features, self.out_features = shared.product.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        return self.shared.part(x, self.reader)

    def extra_repr(self) -> str:
        return f"part {self.reader} of {len(self.shared.bounds)}, out_features={self.out_features}"


class Int8MLP(torch.nn.Module):
    """The gated SiLU MLP of Llama-like models on :class:`Int8Linear` layers: ``down(silu(gate(x)) * up(x))``,
    gate and up one product (``gate_up``, :func:`stacked`) and the activation computed in place."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up = Int8Linear(stacked([mlp.gate_proj, mlp.up_proj]))
        self.down_proj = Int8Linear(mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)  # [..., F] each
        hidden = silu_(gate.contiguous())  # [..., F]: a view of the product for one token, else a copy
        return self.down_proj(hidden.mul_(up))
