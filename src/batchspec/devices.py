"""Which device models run on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked before anything loads.

``auto`` is the first CUDA device when torch sees one, else the CPU. A device that is asked for and missing (a CPU
build of torch, no driver, an index past the GPUs there are) is a ``ValueError`` that says what torch sees, not a
stack trace from inside torch on the first forward.
"""

from __future__ import annotations

import torch

from batchspec.config import AUTO, setting_default


def resolve_device(device: str | torch.device = setting_default("device")) -> torch.device:
    """The ``torch.device`` for ``device``: ``"auto"`` is ``cuda`` when available, else ``cpu``."""
    if isinstance(device, torch.device):
        device = str(device)
    if device == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unsupported device {device!r}; expected auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"Unsupported device {device!r}; expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "is a CPU-only build" if torch.version.cuda is None else "sees no usable CUDA device (driver?)"
        raise ValueError(f"device {device!r} was asked for, but this torch ({torch.__version__}) {why}")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"device {device!r} was asked for, but torch sees {count} CUDA device(s): cuda:0..{count - 1}")
    return torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())


def device_name(device: str | torch.device) -> str:
    """What reports call the device: ``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
