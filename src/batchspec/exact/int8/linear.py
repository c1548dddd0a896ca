"""The int8 linear layer: int8 weights with one scale per output channel, activations quantized per token.

For one token ``x`` (``[K]``) and output channel ``o``: ``y[o] = (acc[o] * sx) * sw[o] + b[o]`` with
``acc = round(x / sx) . W8[o]`` summed exactly in int32, ``sx = max|x| / 127`` and ``sw[o] = max|W[o]| / 127``.
Every step is elementwise or an exact integer sum (see :mod:`batchspec.exact.int8.arithmetic`), so a token's
output does not depend on the other tokens or rows of the call, nor on how the integer kernel blocks the product.
"""

from __future__ import annotations

import torch

from batchspec.exact.int8 import native
from batchspec.exact.int8.arithmetic import EXP2_COEFFICIENTS, exact_silu, quantize_rows
from batchspec.exact.int8.native import ZERO_POINT
from batchspec.exact.int8.product import PackedWeight, activation_codes, int_product, pack_weight, product_kernel


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [O, K], scale [O])`` of a float weight ``[O, K]``: per output channel, in the weight's dtype."""
    q, scale = quantize_rows(weight.detach())
    return q.to(torch.int8).contiguous(), scale[:, 0].contiguous()


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (``weight``: laid out once for this CPU's exact product, see
    :mod:`batchspec.exact.int8.product`; ``scale`` ``[O]``) and per-token int8 activations."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_weight(linear.weight)
        self.weight: PackedWeight = pack_weight(qweight, product_kernel(linear.weight.dtype, qweight.numel()))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.quantizer: SharedQuantization | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        return self.apply_to(quantize_activations(x) if self.quantizer is None else self.quantizer(x))

    def apply_to(self, rows: QuantizedRows, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for activations already quantized (several layers may share one quantization), plus
        ``residual`` (``[..., O]``) where given: ``residual + y``, a decoder layer's residual connection."""
        codes = rows.codes(self.weight.kernel)  # [N, K]
        flat = None if residual is None else residual.reshape(-1, self.out_features)  # [N, O]
        if self.weight.kernel == "native":  # the scales, bias and residual applied in the kernel, in the order below
            y = native.linear(codes, *self.weight.tensors, rows.scale, self.scale, self.bias, flat)  # [N, O]
            return y.reshape(*rows.shape, self.out_features)
        acc = int_product(codes, self.weight, rows.dtype)  # [N, O]: the exact int32 sums, in the float dtype
        y = acc.mul_(rows.scale).mul_(self.scale)  # [N, O]
        if self.bias is not None:
            y.add_(self.bias)
        if flat is not None:
            y.add_(flat)
        return y.reshape(*rows.shape, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Stack:
    """Layers that read one input (an attention's q, k and v; an MLP's gate and up) as one product: their ``native``
    weights stacked in one buffer, which each layer then reads through views of it (its outputs are unchanged:
    each output channel's sum is its own). One pass over the stacked weight gives every layer's output in its own
    tensor (:func:`~batchspec.exact.int8.native.linear_parts`); a one-row step reads the small k and v weights at the
    memory's speed only as part of a larger read."""

    def __init__(self, layers: list[Int8Linear]) -> None:
        self.widths = tuple(layer.out_features for layer in layers)
        panels, sums = (torch.cat([layer.weight.tensors[i] for layer in layers]) for i in (0, 1))
        self.scale = torch.cat([layer.scale for layer in layers])  # [O]
        self.bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])  # [O]
        self.tensors = (panels, sums)
        start = 0
        for layer, width in zip(layers, self.widths, strict=True):
            first = start // native.PANEL
            count = -(-width // native.PANEL)
            layer.weight = PackedWeight("native", (panels[first : first + count], sums[start : start + width]))
            layer.scale = self.scale[start : start + width]
            if self.bias is not None:
                layer.bias = torch.nn.Parameter(self.bias[start : start + width], requires_grad=False)
            start += width

    @classmethod
    def of(cls, layers: list[Int8Linear]) -> Int8Stack | None:
        """The stack of ``layers`` where they can be one (all on the ``native`` kernel, one input size, every width
        but the last a multiple of the kernel's panel, all with a bias or none; float32), else None."""
        first = layers[0]
        if any(layer.weight.kernel != "native" or layer.in_features != first.in_features for layer in layers):
            return None
        if any(layer.out_features % native.PANEL for layer in layers[:-1]):
            return None
        if len({layer.bias is None for layer in layers}) > 1 or first.scale.dtype != torch.float32:
            return None
        return cls(layers)

    def __call__(self, rows: QuantizedRows) -> list[torch.Tensor]:
        """Each layer's output for ``rows`` (``[..., K]`` quantized): ``[..., width]`` per layer."""
        outs = native.linear_parts(rows.codes("native"), *self.tensors, rows.scale, self.scale, self.bias, self.widths)
        return [out.view(*rows.shape, out.shape[-1]) for out in outs]


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
        """The integers in the float dtype, ``[N, K]`` (derived exactly from the ``native`` codes when only those
        were made)."""
        if self._values is None:
            self._values = self._codes["native"][:, : self.inner].to(self.dtype).sub_(ZERO_POINT)
        return self._values

    def codes(self, kernel: str) -> torch.Tensor:
        """The values as ``kernel`` takes them (:func:`~batchspec.exact.int8.product.activation_codes`)."""
        if kernel not in self._codes:
            self._codes[kernel] = activation_codes(self.values, kernel)
        return self._codes[kernel]


def quantize_activations(x: torch.Tensor) -> QuantizedRows:
    """Quantize ``x`` (``[..., K]``) per token to int8; float32 on a CPU with batchspec's native kernels goes
    straight to the ``native`` codes (:func:`~batchspec.exact.int8.native.quantize`, the same bits)."""
    flat = x.reshape(-1, x.shape[-1])  # [N, K]
    if x.dtype == torch.float32 and native.available():
        codes, scale = native.quantize(flat)
        return QuantizedRows(scale, x.dtype, tuple(x.shape[:-1]), x.shape[-1], codes={"native": codes})
    q, scale = quantize_rows(flat)  # [N, K], [N, 1]
    return QuantizedRows(scale, x.dtype, tuple(x.shape[:-1]), x.shape[-1], values=q)


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
        return self.down_proj(gated(self.gate_proj.apply_to(rows), self.up_proj.apply_to(rows)))


def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``exact_silu(gate) * up`` (``[..., F]`` each): the MLP's activation, each value from its operands alone
    (:func:`~batchspec.exact.int8.arithmetic.exact_silu`)."""
    return exact_silu(gate).mul_(up)


def quantize_gated(gate: torch.Tensor, up: torch.Tensor) -> QuantizedRows:
    """``quantize_activations(gated(gate, up))``; with the native kernels neither the SiLU nor the product is written
    out (:func:`~batchspec.exact.int8.native.quantize_gated`, the same bits)."""
    if gate.dtype != torch.float32 or not native.available():
        return quantize_activations(gated(gate, up))
    width = gate.shape[-1]
    codes, scale = native.quantize_gated(gate.reshape(-1, width), up.reshape(-1, width), EXP2_COEFFICIENTS)
    return QuantizedRows(scale, gate.dtype, tuple(gate.shape[:-1]), width, codes={"native": codes})
