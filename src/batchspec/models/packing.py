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
    """``nn.Linear`` with its float32 weight reordered for oneDNN; keeps the original module to swap back."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.original = [linear]  # a list: not registered as a submodule, so parameters are not counted twice
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # still the model's parameter (tied embeddings, vocabulary checks)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(model: torch.nn.Module) -> bool:
    """Packing applies: a float32 model on the CPU, and a PyTorch built with oneDNN."""
    parameter = next(model.parameters())
    return (
        parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def kernels_in_use(model: torch.nn.Module) -> str:
    """``"packed"`` when :func:`pack_linears` swapped ``model``'s linear layers, else ``"default"``."""
    return "packed" if any(isinstance(m, PackedLinear) for m in model.modules()) else "default"


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear` (when :func:`can_pack`); returns how many.
    The packed copies add the size of the linear weights to memory while they are in use."""
    if not can_pack(model):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped


def unpack_linears(model: torch.nn.Module) -> int:
    """Put back the ``nn.Linear`` modules :func:`pack_linears` swapped out; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.original[0])
                swapped += 1
    return swapped
