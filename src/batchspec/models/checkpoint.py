"""Reading a safetensors checkpoint's tensors one at a time, into memory of their own.

transformers 5 loads a safetensors checkpoint lazily: each weight is a view of the file's memory map, read when first
touched, and every page touched counts in the process's resident set for as long as the map lives (as long as any
view of it does). Quantizing a model reads every weight once, so through the map the whole file became resident: the
`qwen2.5-coder` target's 3.55 GB, beside the integer weights being made. :class:`CheckpointReader` reads a tensor
with plain file reads instead (the page cache, which is not the process's), into a buffer that is freed as soon as its
tensor is: the quantization widens, smooths and quantizes one layer's weights at a time, and no view of the map
outlives it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchspec.memory import give_back_freed_memory

# safetensors' dtype names
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class CheckpointReader:
    """The tensors of the ``*.safetensors`` files in ``directory``, by name, each read on demand (:meth:`fresh`)."""

    def __init__(self, directory: Path) -> None:
        self.entries: dict[str, tuple[Path, torch.dtype, list[int], int, int]] = {}
        for path in sorted(directory.glob("*.safetensors")):
            with open(path, "rb") as handle:
                size = struct.unpack("<Q", handle.read(8))[0]
                header = json.loads(handle.read(size))
            for name, entry in header.items():
                if name != "__metadata__" and entry["dtype"] in _DTYPES:
                    start, end = entry["data_offsets"]
                    self.entries[name] = (path, _DTYPES[entry["dtype"]], entry["shape"], 8 + size + start,
                                          8 + size + end)

    @classmethod
    def of(cls, model: Any) -> CheckpointReader | None:
        """The reader of the checkpoint directory ``model`` was loaded from (transformers' ``_name_or_path``), or
        None where it was not loaded from safetensors files on disk."""
        directory = Path(getattr(model.config, "_name_or_path", "") or "")
        return cls(directory) if directory.is_dir() and any(directory.glob("*.safetensors")) else None

    def read(self, name: str, part: slice | None = None) -> torch.Tensor | None:
        """Tensor ``name`` (its rows ``[part]`` where given: a slice with a start and a stop, step 1) in a buffer of
        its own (None where the files hold no such tensor)."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        path, dtype, shape, start, end = entry
        if part is not None:
            row = (end - start) // max(shape[0], 1)
            first, stop = max(part.start, 0), min(part.stop, shape[0])
            start, end, shape = start + first * row, start + max(stop, first) * row, [max(stop - first, 0), *shape[1:]]
        buffer = bytearray(end - start)
        with open(path, "rb", buffering=0) as handle:
            handle.seek(start)
            if handle.readinto(memoryview(buffer)) != end - start:
                raise OSError(f"{path.name} ended inside tensor {name}")
        return torch.frombuffer(buffer, dtype=dtype).view(shape)

    def fresh(self, name: str, tensor: torch.Tensor, part: slice | None = None) -> torch.Tensor:
        """The values of ``tensor`` (its rows ``[part]`` where given), the model's parameter or buffer ``name``, read
        from the files into memory of their own where the files hold it under that name (a tied weight under its
        twin's: ``lm_head.weight`` is ``model.embed_tokens.weight``), else ``tensor`` (``tensor[part]``) itself."""
        for key in (name, *_TWINS.get(name, ())):
            entry = self.entries.get(key)
            if entry is not None and list(entry[2]) == list(tensor.shape) and entry[1] == tensor.dtype:
                return self.read(key, part)
        return tensor if part is None else tensor[part]


# weights that tied checkpoints store once, under their twin's name
_TWINS = {"lm_head.weight": ("model.embed_tokens.weight",)}


def widen_model(model: torch.nn.Module, dtype: torch.dtype, fresh: Callable[[str, torch.Tensor], torch.Tensor],
                linear: Callable[[torch.nn.Linear], torch.nn.Module] | None = None) -> None:
    """``model``, loaded in its files' dtype, made ``dtype`` in place one tensor at a time, each read through
    ``fresh``; each ``nn.Linear``, once its weight is widened, swapped for ``linear(it)`` where given (oneDNN's packed
    layer), so that a float32 model is never held beside a second copy of its weights (and the buffers each layer
    freed go back to the system before the next)."""
    for prefix in [name for name, _ in model.named_modules()]:  # names: no module is held past its swap
        module = model.get_submodule(prefix)
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = fresh(f"{prefix}.{name}" if prefix else name, tensor.data).to(dtype)
        if linear is not None and type(module) is torch.nn.Linear and prefix:
            parent, _, leaf = prefix.rpartition(".")
            setattr(model.get_submodule(parent), leaf, linear(module))
            give_back_freed_memory()  # its weight's read and widened buffers, before the next layer's
