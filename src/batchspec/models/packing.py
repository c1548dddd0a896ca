"""CPU matrix kernels: float32 linear layers with weights prepacked for oneDNN.

On CPUs, PyTorch's float32 ``nn.Linear`` goes through a BLAS (MKL in the CPU wheels) that is tuned for large
matrices and, on AMD CPUs, does not use its fastest paths: for the few rows a decoding step or a verification
of a few drafts multiplies, it reads the weights at about half the memory bandwidth. oneDNN's linear with the
weight reordered once into its blocked layout (what ``torch.compile``'s freezing does on the CPU) reads them
near full speed, and its cost grows more slowly with the number of rows, which is what speculation pays for.

The arithmetic stays float32 and only the summation order differs, like between any two BLAS kernels or batch
sizes: outputs are equal up to float32 near-ties (see ``batchspec audit``). :func:`pack_linears` swaps every
``nn.Linear`` of a float32 model on the CPU for a :class:`PackedLinear` holding the reordered weight;
:func:`unpack_linears` swaps them back.
"""

from __future__ import annotations

import torch

# the row count oneDNN tunes the packed layout for: a few rows, as in decoding and verification
PACK_ROWS_HINT = 8


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` with its float32 weight reordered for oneDNN, which it holds instead of the weight (the packed
    copy gives the values back exactly: ``weight``), so the model holds each linear weight once. A tied output
    layer's weight lives on in the input embedding that shares it."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)  # [O, K]
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:  # [O, K]
        """The weight's values, read back from the packed copy into a new tensor at each access (for reading, not
        for a forward)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """A state dict holds the weight as ``nn.Linear`` does (read back from the packed copy: the same values)."""
        destination[f"{prefix}weight"] = self.weight
        if self.bias is not None:
            destination[f"{prefix}bias"] = self.bias

    def unpacked(self) -> torch.nn.Linear:
        """The ``nn.Linear`` this was made from: the same weight and bias values."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias, requires_grad=False)
        return linear


def can_pack(model: torch.nn.Module) -> bool:
    """Packing applies: a float32 model on the CPU, and a PyTorch built with oneDNN."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32 and onednn_linear()


def onednn_linear() -> bool:
    """This PyTorch has oneDNN's linear with a prepacked weight."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def kernels_in_use(model: torch.nn.Module) -> str:
    """``"packed"`` when :func:`pack_linears` swapped ``model``'s linear layers, else ``"default"``."""
    return "packed" if any(isinstance(m, PackedLinear) for m in model.modules()) else "default"


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear` (when :func:`can_pack`); returns how many.
    Each float32 weight is freed once packed (unless another module shares it), so the model's size stays."""
    if not can_pack(model):
        return 0
    places = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, torch.nn.Linear)]  # names, not modules: each float weight is freed once packed
    for parent, name in places:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(places)


def unpack_linears(model: torch.nn.Module) -> int:
    """Swap every :class:`PackedLinear` of ``model`` back for an ``nn.Linear`` of the same values; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.unpacked())
                swapped += 1
    return swapped
