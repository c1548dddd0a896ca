"""The int8 linear layer: int8 weights with one scale per output channel, activations quantized per token.

For one token ``x`` (``[K]``) and output channel ``o``: ``y[o] = (acc[o] * sx) * sw[o] + b[o]`` with
``acc = round(x / sx) . W8[o]`` summed exactly in int32, ``sx = max|x| / 127`` and ``sw[o] = max|W[o]| / 127``.
Every step is elementwise or an exact integer sum (see :mod:`batchspec.models.int8.arithmetic`), so a token's
output does not depend on the other tokens or rows of the call, nor on how the integer kernel blocks the product.
"""

from __future__ import annotations

import torch

from batchspec.models.int8.arithmetic import int_matmul, int_mm_saturates, quantize_rows, split_weight


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [O, K], scale [O])`` of a float weight ``[O, K]``: per output channel, rounded in float64."""
    q, scale = quantize_rows(weight.detach().to(torch.float64))
    return q.to(torch.int8).contiguous(), scale[:, 0].to(weight.dtype)


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (``qweight`` ``[O, K]``, ``scale`` ``[O]``) and per-token int8 activations."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_weight(linear.weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        # CPUs whose int8 kernel saturates get the weight as two exact halves instead (see int_matmul)
        self.halves = split_weight(qweight) if int_mm_saturates() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        rows = x.reshape(-1, self.in_features)  # [N, K]
        q, row_scale = quantize_rows(rows)  # [N, K], [N, 1]
        acc = int_matmul(q.to(torch.int8), self.qweight, self.halves)  # [N, O] int32, exact
        y = acc.to(x.dtype) * row_scale * self.scale  # [N, O]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
