"""The integer linear layers and the MLP on them.

* :class:`Int8Linear`: int8 weights with one scale per output channel, activations quantized per token. For one token
  ``x`` (``[K]``) and output channel ``o``: ``y[o] = (acc[o] * sx) * sw[o] + b[o]`` with ``acc = round(x / sx) .
  W8[o]`` summed exactly in int32, ``sx = max|x| / 127`` and ``sw[o] = max|W[o]| / 127``.
* :class:`Int4Linear`: int4 weights in GGUF's Q4_K grid, activations quantized per super-block
  (:mod:`batchspec.exact.integer.int4`).

Every step is elementwise or an exact integer sum (see :mod:`batchspec.exact.integer.arithmetic`), so a token's
output does not depend on the other tokens or rows of the call, nor on how the integer kernel blocks the product.
:class:`QuantizedRows` holds one input's activations in each form its readers take, each made once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from batchspec.exact.integer import int4, native
from batchspec.exact.integer.arithmetic import ACTIVATIONS, EXP2_COEFFICIENTS, exact_activation, quantize_rows
from batchspec.exact.integer.native import ZERO_POINT
from batchspec.exact.integer.product import PackedWeight, activation_codes, int_product, pack_weight, product_kernel
from batchspec.memory import weight_buffer

WEIGHT_ROWS = 4096  # output channels read and quantized at a time: an output layer is never whole in float or int8

# a weight's output channels ``[start:stop]`` as a float tensor ``[R, K]`` (read from a checkpoint, or sliced)
Rows = Callable[[slice], torch.Tensor]


def quantized_weight(rows: Rows, shape: tuple[int, int], dtype: torch.dtype) -> tuple[PackedWeight, torch.Tensor]:
    """``(weight, scale [O])``: the float weight ``[O, K]`` whose channels ``rows`` reads, quantized per output
    channel in ``dtype`` (:func:`quantize_rows`; a channel's values depend on its own row alone) and laid out for
    its kernel, :data:`WEIGHT_ROWS` channels at a time. On the ``native`` kernel each part is packed into its place
    (:func:`~batchspec.exact.integer.native.pack_into`) as it is made, so neither the float weight nor its int8
    codes are ever whole; the other kernels lay out the whole int8 weight."""
    outputs, inner = shape
    kernel = product_kernel(dtype, outputs * inner)
    scales = torch.empty(outputs, dtype=dtype)  # [O]
    packed = native.empty_pack(outputs, inner) if kernel == "native" else None
    codes = None if packed is not None else torch.empty(shape, dtype=torch.int8)  # [O, K]
    for start in range(0, outputs, WEIGHT_ROWS):
        part = slice(start, min(start + WEIGHT_ROWS, outputs))
        q, scale = quantize_rows(rows(part).detach().to(dtype))  # [R, K], [R, 1]
        scales[part] = scale[:, 0]
        if packed is None:
            codes[part] = q
        else:
            native.pack_into(q.to(torch.int8), *packed, start)
    return (PackedWeight(kernel, packed) if packed is not None else pack_weight(codes, kernel)), scales


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (``weight``: laid out once for this CPU's exact product, see
    :mod:`batchspec.exact.integer.product`; ``scale`` ``[O]``) and per-token int8 activations, computed in ``dtype``
    (default: ``linear``'s). ``rows`` reads the float weight's output channels where the caller reads them (from a
    checkpoint, a part at a time: :func:`quantized_weight`), else ``linear``'s weight is read."""

    def __init__(self, linear: torch.nn.Linear, rows: Rows | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = dtype or linear.weight.dtype
        rows = rows or (lambda part: linear.weight[part])
        self.weight, scale = quantized_weight(rows, (self.out_features, self.in_features), dtype)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.quantizer: SharedQuantization | None = None

    block = None  # its activations are quantized per token, not in blocks

    def forward(self, x: torch.Tensor, outputs: int | None = None) -> torch.Tensor:  # [..., K] -> [..., O]
        """``outputs``: the first ``outputs`` outputs only (see :meth:`apply_to`)."""
        rows = quantize_activations(x) if self.quantizer is None else self.quantizer(x)
        return self.apply_to(rows, outputs=outputs)

    def apply_to(self, rows: QuantizedRows, residual: torch.Tensor | None = None,
                 outputs: int | None = None) -> torch.Tensor:
        """The layer's output for activations already quantized (several layers may share one quantization), plus
        ``residual`` (``[..., O]``) where given: ``residual + y``, a decoder layer's residual connection. With
        ``outputs``, its first ``outputs`` outputs, the same bits (each output's sum is its own): the native kernel
        then reads only the panels that hold them (an output layer over part of a vocabulary reads that part)."""
        if residual is not None and outputs is not None:
            raise ValueError("a residual is added to every output, not to the first outputs alone")
        codes = rows.codes(self.weight.kernel)  # [N, K]
        flat = None if residual is None else residual.reshape(-1, self.out_features)  # [N, O]
        width = self.out_features if outputs is None else min(outputs, self.out_features)
        if self.weight.kernel == "native":  # the scales, bias and residual applied in the kernel, in the order below
            panels, sums = self.weight.tensors
            count = -(-width // native.PANEL)  # the whole panels that hold the first width outputs
            read = min(count * native.PANEL, self.out_features)
            bias = None if self.bias is None else self.bias[:read]
            y = native.linear(codes, panels[:count], sums[:read], rows.scale, self.scale[:read], bias, flat)
            return y[:, :width].reshape(*rows.shape, width)  # y: [N, read]
        acc = int_product(codes, self.weight, rows.dtype)  # [N, O]: the exact int32 sums, in the float dtype
        y = acc.mul_(rows.scale).mul_(self.scale)  # [N, O]
        if self.bias is not None:
            y.add_(self.bias)
        if flat is not None:
            y.add_(flat)
        return y[:, :width].reshape(*rows.shape, width)

    def gated_rows(self, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> QuantizedRows:
        """The MLP's ``gated(gate, up, activation)`` as this layer reads it (:func:`quantize_gated`)."""
        return quantize_gated(gate, up, activation)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """Packed weights (one layout, ``[P_i, ...]`` each) as one ``[sum P_i, ...]`` buffer (:func:`weight_buffer`)."""
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    return torch.cat(parts, out=weight_buffer(shape, parts[0].dtype))


class Int8Stack:
    """Layers that read one input (an attention's q, k and v; an MLP's gate and up) as one product: their ``native``
    weights stacked in one buffer, which each layer then reads through views of it (its outputs are unchanged:
    each output channel's sum is its own). One pass over the stacked weight gives every layer's output in its own
    tensor (:func:`~batchspec.exact.integer.native.linear_parts`); a one-row step reads the small k and v weights at the
    memory's speed only as part of a larger read."""

    block = None  # its activations are quantized per token

    def __init__(self, layers: list[Int8Linear]) -> None:
        self.widths = tuple(layer.out_features for layer in layers)
        self.in_features = layers[0].in_features
        panels = stacked([layer.weight.tensors[0] for layer in layers])  # [P, G, 64, 4]
        sums = torch.cat([layer.weight.tensors[1] for layer in layers])  # [O]
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
        if not all(isinstance(layer, Int8Linear) and layer.weight.kernel == "native" for layer in layers):
            return None
        if any(layer.in_features != first.in_features for layer in layers):
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
    """One input's activations (``[..., K]``, ``shape`` the leading dimensions, ``dtype`` the float dtype they had) in
    the forms the products take, each made once from the float ``source`` (``[N, K]``) where it is held:

    * per token (:class:`Int8Linear`): ``scale`` ``[N, 1]`` and the integers in ``[-127, 127]`` as each int8 kernel
      takes them (:meth:`codes`; :attr:`values` holds them in the float dtype, ``[N, K]``);
    * per super-block (:class:`Int4Linear`): :meth:`blocks`, for a block size.

    Rows quantized straight from a fused kernel hold only that form (``codes`` with ``scale``, or ``blocked``)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], inner: int, *, source: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 codes: dict[str, torch.Tensor] | None = None,
                 blocked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> None:
        if source is None and scale is None and not blocked:
            raise ValueError("quantized rows need their float source, their per-token scale or a blocked form")
        if scale is not None and values is None and not codes:
            raise ValueError("per-token rows need their values or the codes of one kernel")
        self.dtype, self.shape, self.inner, self.source = dtype, shape, inner, source
        self._scale, self._values, self._codes, self._blocked = scale, values, dict(codes or {}), dict(blocked or {})

    @property
    def scale(self) -> torch.Tensor:
        """The per-token scale, ``[N, 1]``."""
        if self._scale is None:
            self._per_token()
        return self._scale

    @property
    def values(self) -> torch.Tensor:
        """The integers in the float dtype, ``[N, K]`` (derived exactly from the ``native`` codes when only those
        were made)."""
        if self._scale is None:
            self._per_token()
        if self._values is None:
            self._values = self._codes["native"][:, : self.inner].to(self.dtype).sub_(ZERO_POINT)
        return self._values

    def codes(self, kernel: str) -> torch.Tensor:
        """The values as ``kernel`` takes them (:func:`~batchspec.exact.integer.product.activation_codes`)."""
        if self._scale is None:
            self._per_token()
        if kernel not in self._codes:
            self._codes[kernel] = activation_codes(self.values, kernel)
        return self._codes[kernel]

    def blocks(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int4 product's activations in blocks of ``block``
        (:func:`~batchspec.exact.integer.int4.quantize_blocks`)."""
        if block not in self._blocked:
            if self.source is None:
                raise ValueError(f"these rows were quantized per token only, not in blocks of {block}")
            self._blocked[block] = int4.quantize_blocks(self.source, block)
        return self._blocked[block]

    def _per_token(self) -> None:
        """Quantize the source per token: straight to the ``native`` codes where the native kernels run (the same
        bits)."""
        if self.source is None:
            raise ValueError("these rows were quantized in blocks only, not per token")
        if self.source.dtype == torch.float32 and native.available():
            codes, self._scale = native.quantize(self.source)
            self._codes["native"] = codes
        else:
            self._values, self._scale = quantize_rows(self.source)  # [N, K], [N, 1]


def quantize_activations(x: torch.Tensor) -> QuantizedRows:
    """``x`` (``[..., K]``) as :class:`QuantizedRows`, each form made when a product first asks for it."""
    return QuantizedRows(x.dtype, tuple(x.shape[:-1]), x.shape[-1], source=x.reshape(-1, x.shape[-1]))


class SharedQuantization:
    """One quantization for ``readers`` layers called one after another on the same input tensor (an attention's q,
    k and v projections read one ``hidden_states``): the rows are reused while the input is that same tensor object,
    which is held (so no other tensor can take its place in memory) until the last reader has had them. Each thread
    keeps its own: two engines may run one model from two threads (two servers of one process), and a forward must
    not take the other's rows or see them let go between its check and its read."""

    def __init__(self, readers: int) -> None:
        self.readers = readers
        self._local = threading.local()  # .last: (input, its rows) or None; .served: readers that had them

    def __getstate__(self) -> dict:  # a model copied (deepcopy, pickle) shares no thread's rows
        return {"readers": self.readers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["readers"])

    def __call__(self, x: torch.Tensor) -> QuantizedRows:
        state = self._local
        last = getattr(state, "last", None)
        if last is None or last[0] is not x:
            last = state.last = (x, quantize_activations(x))
            state.served = 0
        state.served += 1
        if state.served == self.readers:
            state.last = None
        return last[1]


class Int4Linear(torch.nn.Module):
    """``nn.Linear`` with an int4 weight (:class:`~batchspec.exact.integer.int4.Int4Weight`) and activations quantized
    per super-block: ``packed`` as the native kernels read it where a build runs here (the only copy held), else the
    weight itself for the torch path (``weight4``)."""

    def __init__(self, weight: int4.Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.inner, weight.outputs
        self.block, self.subs = weight.block, weight.subs
        self.weight4: int4.Int4Weight | None = None if native.available() else weight
        self.register_buffer("packed", weight.packed() if self.weight4 is None else None)  # [P, bytes] uint8
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.quantizer: SharedQuantization | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        return self.apply_to(quantize_activations(x) if self.quantizer is None else self.quantizer(x))

    def apply_to(self, rows: QuantizedRows, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for ``rows`` (their blocked form), plus ``residual`` (``[..., O]``) where given."""
        blocked = rows.blocks(self.block)
        flat = None if residual is None else residual.reshape(-1, self.out_features)  # [N, O]
        if self.weight4 is None:
            y = native.linear4(blocked, self.packed, self.in_features, self.subs, self.out_features, self.bias,
                               residual=flat)[0]  # [N, O]
        else:
            y = int4.int4_product(blocked, self.weight4, self.bias)  # [N, O]
            y = y if flat is None else flat + y
        return y.reshape(*rows.shape, self.out_features)

    def gated_rows(self, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> QuantizedRows:
        """The MLP's ``gated(gate, up, activation)`` (``[..., F]`` each) as this layer reads it: in its blocks,
        neither the activation nor the product written out where the native kernels run."""
        if gate.dtype != torch.float32 or not native.available():
            return quantize_activations(gated(gate, up, activation))
        width = gate.shape[-1]
        blocked = native.quantize_gated_blocks(gate.reshape(-1, width), up.reshape(-1, width), EXP2_COEFFICIENTS,
                                               self.block, ACTIVATIONS[activation])
        return QuantizedRows(gate.dtype, tuple(gate.shape[:-1]), width, blocked={self.block: blocked})

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}")


IntLinear = Int8Linear | Int4Linear


class Int4Stack:
    """:class:`Int4Linear` layers that read one input (q, k and v; gate and up), their packed panels stacked in one
    buffer that each layer then reads through a view of it: one pass of the kernel gives every layer's output in its
    own tensor (each output channel's sum is its own, so the outputs are unchanged)."""

    block: int

    def __init__(self, layers: list[Int4Linear]) -> None:
        first = layers[0]
        self.widths = tuple(layer.out_features for layer in layers)
        self.block, self.subs, self.in_features = first.block, first.subs, first.in_features
        self.packed = stacked([layer.packed for layer in layers])  # [P, bytes]
        self.bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])  # [O]
        panel, start = 0, 0
        for layer, width in zip(layers, self.widths, strict=True):
            count = -(-width // native.PANEL4)
            layer.packed = self.packed[panel : panel + count]
            if self.bias is not None:
                layer.bias = torch.nn.Parameter(self.bias[start : start + width], requires_grad=False)
            panel, start = panel + count, start + width

    @classmethod
    def of(cls, layers: list[IntLinear]) -> Int4Stack | None:
        """The stack of ``layers`` where they can be one (all int4 on the native kernels, one input size and
        super-block, every width but the last a multiple of the kernel's panel, all with a bias or none), else
        None."""
        if not all(isinstance(layer, Int4Linear) and layer.packed is not None for layer in layers):
            return None
        first = layers[0]
        if any((layer.in_features, layer.subs) != (first.in_features, first.subs) for layer in layers):
            return None
        if any(layer.out_features % native.PANEL4 for layer in layers[:-1]):
            return None
        if len({layer.bias is None for layer in layers}) > 1:
            return None
        return cls(layers)

    def __call__(self, rows: QuantizedRows) -> list[torch.Tensor]:
        """Each layer's output for ``rows`` (``[..., K]`` quantized): ``[..., width]`` per layer."""
        outs = native.linear4(rows.blocks(self.block), self.packed, self.in_features, self.subs, sum(self.widths),
                              self.bias, self.widths)
        return [out.view(*rows.shape, out.shape[-1]) for out in outs]


class QuantizedMLP(torch.nn.Module):
    """The gated MLP of Llama-like models on integer layers (:class:`Int8Linear` or :class:`Int4Linear`, each as its
    weight came): ``down(act(gate(x)) * up(x))``, ``act`` the exact function of ``activation`` (transformers' name:
    ``silu``, or Gemma's ``gelu_pytorch_tanh``; :func:`~batchspec.exact.integer.arithmetic.exact_activation`), with
    ``x`` quantized once for gate and up and the activation computed in place."""

    def __init__(self, gate: IntLinear, up: IntLinear, down: IntLinear, activation: str = "silu") -> None:
        super().__init__()
        exact_activation(activation)  # raises for an activation the exact model does not compute
        self.gate_proj, self.up_proj, self.down_proj, self.activation = gate, up, down, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        rows = quantize_activations(x)
        return self.down_proj(gated(self.gate_proj.apply_to(rows), self.up_proj.apply_to(rows), self.activation))


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` (``[..., F]`` each): the MLP's activation ``activation``, each value from its operands
    alone (:func:`~batchspec.exact.integer.arithmetic.exact_activation`)."""
    return exact_activation(activation)(gate).mul_(up)


def quantize_gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> QuantizedRows:
    """``quantize_activations(gated(gate, up, activation))`` per token; with the native kernels neither the
    activation nor the product is written out (:func:`~batchspec.exact.integer.native.quantize_gated`, the same
    bits)."""
    if gate.dtype != torch.float32 or not native.available():
        return quantize_activations(gated(gate, up, activation))
    width = gate.shape[-1]
    codes, scale = native.quantize_gated(gate.reshape(-1, width), up.reshape(-1, width), EXP2_COEFFICIENTS,
                                         ACTIVATIONS[activation])
    return QuantizedRows(gate.dtype, tuple(gate.shape[:-1]), width, scale=scale, codes={"native": codes})
