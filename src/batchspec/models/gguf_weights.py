"""A GGUF file's own 4-bit weights for the model loaded from it (``--quantize int4``).

The dense model batchspec loads from a GGUF file (a preset's cache, or the file through transformers) holds the
dequantization of each weight, already rounded to bf16 in a preset's cache. :class:`GgufInt4Source` hands the int4
model the file's own blocks instead: for a linear layer it finds the tensor (gguf's name map, the layer index through
a derived draft's kept layers), reads its Q4_0 / Q4_1 / Q4_K blocks as an
:class:`~batchspec.exact.integer.int4.Int4Weight`, undoes the row order llama.cpp gives Llama's q and k (as
transformers does), and checks that it expands to the loaded weight, so a wrong tensor can never be used silently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from batchspec.exact.integer.int4 import GGUF_INT4, Int4Weight, from_gguf


@dataclass(frozen=True)
class GgufOrigin:
    """Where a model's weights came from: the GGUF file, and for a draft derived from it the file's layer index of
    each of its layers (None: the model's own indices)."""

    path: Path
    layers: tuple[int, ...] | None = None


def four_bit(origin: GgufOrigin) -> bool:
    """Whether ``origin``'s file holds the weights of its decoder layers in 4-bit blocks (Q4_0, Q4_1, Q4_K: what
    int4 keeps as they are), most of them by count: a Q4_K_M file does (its 6-bit tensors are a minority), a Q8_0 one
    does not."""
    return _four_bit(origin.path, origin.path.stat().st_mtime_ns)


@functools.cache
def _four_bit(path: Path, modified: int) -> bool:
    from gguf import GGUFReader

    kinds = [t.tensor_type.name for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.") and
             t.name.endswith(".weight") and len(t.shape) == 2]
    return sum(kind in GGUF_INT4 for kind in kinds) * 2 > len(kinds)


class GgufInt4Source:
    """``source(name)`` -> the int4 weight of linear layer ``name`` (``model.layers.3.mlp.up_proj``) as the file
    holds it, or None where the file holds that weight in another type; ``model`` is the loaded model, whose weights
    the blocks must expand to (bf16-rounded, as a preset caches them)."""

    def __init__(self, origin: GgufOrigin, model: torch.nn.Module) -> None:
        from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

        self.origin, self.model = origin, model
        self.reader = GGUFReader(str(origin.path))
        self.arch = bytes(_field(self.reader, "general.architecture")).decode()
        blocks = int(_field(self.reader, f"{self.arch}.block_count")[0])
        key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == self.arch), None)
        if key is None:
            raise ValueError(f"{origin.path.name}: gguf knows no architecture {self.arch!r}")
        self.names = get_tensor_name_map(key, blocks)
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}

    def __call__(self, name: str) -> Int4Weight | None:
        tensor = self.tensors.get(f"{self.tensor_name(name)}.weight")
        if tensor is None:
            raise ValueError(f"{self.origin.path.name} holds no tensor for {name}")
        if tensor.tensor_type.name not in GGUF_INT4:
            return None
        weight = from_gguf(tensor.tensor_type.name, tensor.data, int(tensor.shape[0]))
        if self.arch == "llama" and name.endswith(("q_proj", "k_proj")):
            weight = _reorder(weight, self._heads(name))
        loaded = self.model.get_submodule(name).weight
        if not torch.equal(weight.values().bfloat16(), loaded.detach().bfloat16()):
            raise ValueError(f"{self.origin.path.name}: the blocks of {tensor.name} do not expand to {name}'s weight")
        return weight

    def tensor_name(self, name: str) -> str:
        """The file's name of module ``name``: gguf's map, after the layer index of a derived draft is the file's."""
        parts = name.split(".")
        if self.origin.layers is not None and len(parts) > 2 and parts[-3].isdigit():
            parts[-3] = str(self.origin.layers[int(parts[-3])])
        mapped = self.names.get_name(".".join(parts))
        if mapped is None:
            raise ValueError(f"gguf's name map has no tensor for {name}")
        return mapped

    def _heads(self, name: str) -> int:
        config = self.model.config
        return config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads


def _field(reader, key: str):
    """The value of metadata ``key`` as gguf's reader holds it (a numpy array: a string's bytes, a number)."""
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF file has no {key}")
    return field.parts[field.data[0]]


def _reorder(weight: Int4Weight, heads: int) -> Int4Weight:
    """``weight`` with its outputs in transformers' order for Llama's q or k: llama.cpp interleaves each head's two
    rotary halves, transformers' ``_reverse_permute_weights`` undoes it (row ``(h, i, j)`` of ``[heads, 2, size/2]``
    comes from row ``(h, j, i)`` of ``[heads, size/2, 2]``)."""
    half = weight.outputs // heads // 2
    order = _order(heads, half)
    return Int4Weight(*(t[order] for t in (weight.nibbles, weight.scales, weight.mins, weight.d, weight.dmin)),
                      weight.subs, weight.inner)


@functools.cache
def _order(heads: int, half: int) -> torch.Tensor:
    return torch.arange(heads * half * 2).view(heads, half, 2).transpose(1, 2).reshape(-1)
