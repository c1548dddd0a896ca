"""Counting the places where the host reads the device, on any device.

On CUDA a read of a tensor's values by the host (``.tolist()``, ``.item()``, ``bool(t)``, ``int(t)``, ``nonzero``,
indexing with a boolean mask, ...) waits for the device: a synchronisation. On the CPU nothing waits, but the same
calls are made, so counting them with a :class:`~torch.overrides.TorchFunctionMode` tells, on the CPU, how many
synchronisations a round would cost on a GPU (transformers' own calls inside a forward included).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        "tolist", "item", "numpy", "cpu", "nonzero", "masked_select", "unique", "equal", "allclose",
        "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__", "__str__",
    }
)
MASKABLE = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
COPIES = frozenset({"tensor", "as_tensor"})  # a tensor made from host values: one host→device copy on a GPU


class HostReads(TorchFunctionMode):
    """Counts device→host reads while active (``where`` names the line of batchspec or transformers that read),
    and tensors made from host values (``copies``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.copies = 0
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name in MASKABLE and _has_mask(args)):
            self.count += 1
            self.where[_caller(name)] += 1
        self.copies += name in COPIES
        return func(*args, **(kwargs or {}))


def _has_mask(args) -> bool:
    """Whether an index among ``args`` is a boolean tensor (indexing by it reads the mask to size the result)."""
    indices = args[1] if len(args) > 1 else ()
    indices = indices if isinstance(indices, tuple | list) else (indices,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _caller(name: str) -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "batchspec" in f.filename or "transformers" in f.filename]
    if not frames:
        return name
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {name}"
