"""A GGUF file's own blocks for the integer model loaded from it: its 4-bit weights (``--quantize int4``) and its
token embedding (int8 and int4).

The dense model batchspec loads from a GGUF file (a preset's cache, or the file through transformers) holds the
dequantization of each weight, already rounded to bf16 in a preset's cache. :class:`GgufWeights` hands the integer
model the file's own blocks instead:

* for a linear layer (int4) it finds the tensor (gguf's name map, the layer index through a derived draft's kept
  layers), reads its Q4_0 / Q4_1 / Q4_K blocks as an :class:`~batchspec.exact.integer.int4.Int4Weight`, undoes the
  row order llama.cpp gives Llama's q and k (as transformers does), and checks that it expands to the loaded weight,
  so a wrong tensor can never be used silently;
* for the input embedding it holds the file's rows as they are (:class:`GgufEmbedding`: the qwen2.5-coder target's
  Q4_K table is 131 MB where its bf16 one is 467 MB), each row looked up expanded as gguf expands it and rounded as
  the loaded table was, once it has been checked to expand to the loaded table (every 16th row).

The file is read through :class:`GgufIndex`, which reads the header's tensor table and the two metadata values it
needs and steps over the rest: gguf's ``GGUFReader`` builds every metadata field, and a 151,936-token vocabulary took
it 12.6 s of a 36.7 s load (2 vCPUs of a Zen 4).
"""

from __future__ import annotations

import functools
import logging
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchspec.exact.integer.int4 import GGUF_INT4, Int4Weight, from_gguf

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# the struct format of each fixed-size metadata value type (gguf's GGUFValueType; 8 is a string, 9 an array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its type's name (``"Q4_K"``), its shape as transformers sees it (``[O, K]``) and
    where its raw bytes lie (``rows`` rows of ``row_bytes`` from byte ``start`` of ``path``)."""

    kind: str
    shape: tuple[int, ...]
    path: Path
    start: int
    rows: int
    row_bytes: int

    def read(self) -> np.ndarray:
        """The raw bytes, ``[rows, row_bytes]`` uint8, read from the file into memory of their own (a view of a
        mapping would keep the file's pages in the process's resident set for as long as the weight lives)."""
        raw = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.start)
            if handle.readinto(memoryview(raw).cast("B")) != raw.nbytes:
                raise OSError(f"{self.path.name} ended inside a tensor")
        return raw


class GgufIndex:
    """A GGUF file's tensor table and its ``general.architecture`` and ``<arch>.block_count`` (GGUF v2 and v3,
    little-endian), read once through a read-only mapping that is closed after; the other metadata is stepped over,
    not decoded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            self._read(data)

    def _read(self, data: mmap.mmap) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if data[:4] != GGUF_MAGIC or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
            raise ValueError(f"{self.path.name} is not a GGUF file of version 2 or 3 (little-endian)")
        tensors, fields = struct.unpack_from("<QQ", data, 8)
        offset, values = 24, {}
        for _ in range(fields):
            key, offset = _string(data, offset)
            kind = struct.unpack_from("<I", data, offset)[0]
            value, offset = _value(data, offset + 4, kind)
            values[key] = value
        self.arch = str(values.get("general.architecture", ""))
        self.blocks = int(values.get(f"{self.arch}.block_count", 0))
        alignment = int(values.get("general.alignment", 32))
        table = []
        for _ in range(tensors):
            name, offset = _string(data, offset)
            dims = struct.unpack_from(f"<{struct.unpack_from('<I', data, offset)[0]}Q", data, offset + 4)
            offset += 4 + 8 * len(dims)
            kind, start = struct.unpack_from("<IQ", data, offset)
            offset += 12
            table.append((name, dims, GGMLQuantizationType(kind), start))
        base = -(-offset // alignment) * alignment
        self.tensors: dict[str, GgufTensor] = {}
        for name, dims, kind, start in table:
            block, size = GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            if base + start + rows * (dims[0] // block * size) > len(data):
                raise ValueError(f"{self.path.name} ends inside tensor {name}")
            self.tensors[name] = GgufTensor(kind.name, tuple(reversed(dims)), self.path, base + start, rows,
                                            dims[0] // block * size)


def _string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    length = struct.unpack_from("<Q", data, offset)[0]
    return data[offset + 8 : offset + 8 + length].decode(), offset + 8 + length


def _value(data: mmap.mmap, offset: int, kind: int) -> tuple[object, int]:
    """A metadata value of type ``kind`` at ``offset`` and the offset past it; an array's elements are stepped over
    (its value is None)."""
    if kind == _STRING:
        return _string(data, offset)
    if kind == _ARRAY:
        element, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if element in _SCALARS:
            return None, offset + count * struct.calcsize(_SCALARS[element])
        for _ in range(count):
            _, offset = _value(data, offset, element)
        return None, offset
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF metadata type {kind}")
    return struct.unpack_from(_SCALARS[kind], data, offset)[0], offset + struct.calcsize(_SCALARS[kind])


@functools.cache
def gguf_index(path: Path, modified: int) -> GgufIndex:
    """:class:`GgufIndex` of ``path``, read once per process (and again if the file's modification time moves)."""
    return GgufIndex(path)


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
    index = gguf_index(origin.path, origin.path.stat().st_mtime_ns)
    kinds = [t.kind for name, t in index.tensors.items()
             if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2]
    return sum(kind in GGUF_INT4 for kind in kinds) * 2 > len(kinds)


class GgufWeights:
    """The file's own blocks for the integer model of ``model`` (the model loaded from it, whose weights the blocks
    must expand to, bf16-rounded as a preset caches them, read through ``fresh`` where given; see
    :func:`batchspec.exact.integer.model.quantize_model`): :meth:`int4` and :meth:`embedding`."""

    def __init__(self, origin: GgufOrigin, model: torch.nn.Module,
                 fresh: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.origin, self.model = origin, model
        self.fresh = fresh or (lambda name, tensor: tensor)
        index = gguf_index(origin.path, origin.path.stat().st_mtime_ns)
        self.arch, self.tensors = index.arch, index.tensors
        key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == self.arch), None)
        if self.arch in FUSED_ARCHITECTURES:
            raise ValueError(f"{origin.path.name}: a GGUF file of {self.arch} holds fused q, k, v or gate, up tensors "
                             "(split at quantization from a checkpoint's, not from a file's blocks); load its "
                             "safetensors checkpoint instead")
        if key is None:
            raise ValueError(f"{origin.path.name}: gguf knows no architecture {self.arch!r}")
        self.names = get_tensor_name_map(key, index.blocks)

    def int4(self, name: str) -> Int4Weight | None:
        """The int4 weight of linear layer ``name`` (``model.layers.3.mlp.up_proj``) as the file holds it, or None
        where the file holds that weight in another type."""
        tensor = self.tensors.get(f"{self.tensor_name(name)}.weight")
        if tensor is None:
            raise ValueError(f"{self.origin.path.name} holds no tensor for {name}")
        if tensor.kind not in GGUF_INT4:
            return None
        weight = from_gguf(tensor.kind, tensor.read(), tensor.shape[-1])
        if self.arch == "llama" and name.endswith(("q_proj", "k_proj")):
            weight = _reorder(weight, self._heads(name))
        loaded = self.fresh(f"{name}.weight", self.model.get_submodule(name).weight.detach())
        if not torch.equal(weight.values().bfloat16(), loaded.bfloat16()):
            raise ValueError(f"{self.origin.path.name}: the blocks of {tensor.name} do not expand to {name}'s weight")
        return weight

    def embedding(self, name: str, table: torch.Tensor, dtype: torch.dtype) -> GgufEmbedding | None:
        """The input embedding ``name`` (``model.embed_tokens``, whose loaded ``table`` is ``[V, H]``) as the file's
        own rows, looked up in ``dtype`` (:class:`GgufEmbedding`); None where the file holds it unquantized or it does
        not expand to ``table`` (then one log line says so, and the table is kept)."""
        tensor = self.tensors.get(f"{self.tensor_name(name)}.weight")
        if tensor is None or tensor.kind in UNQUANTIZED or tensor.shape != tuple(table.shape):
            return None
        embedding = GgufEmbedding(tensor.kind, torch.from_numpy(tensor.read()), table.dtype, dtype)
        if not embedding.expands_to(table):
            logger.warning("batchspec: %s: the %s rows of %s do not expand to %s's table; the table is kept",
                           self.origin.path.name, tensor.kind, tensor.name, name)
            return None
        return embedding

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


# GGUF architectures of the families whose projections batchspec splits (Phi-3's qkv and gate_up, GLM-4's gate_up;
# batchspec.exact.integer.model.split_fused): their file blocks are not read
FUSED_ARCHITECTURES = ("phi3", "glm4")
UNQUANTIZED = ("F32", "F16", "BF16", "F64")  # GGUF types a table takes as many bytes in as a dense one


class GgufEmbedding(torch.nn.Module):
    """A token embedding held as a GGUF file's rows of blocks (``blocks`` ``[V, row bytes]`` uint8, type ``kind``):
    a lookup expands the rows it reads as gguf's dequantization expands them (float32), rounds them to ``stored``
    (the dtype the loaded table held them in) and widens them to ``dtype``: the values of the loaded table's rows,
    for every id, in a quarter to a half of its memory."""

    def __init__(self, kind: str, blocks: torch.Tensor, stored: torch.dtype, dtype: torch.dtype) -> None:
        super().__init__()
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.kind, self.stored, self.dtype = GGMLQuantizationType[kind], stored, dtype
        values, size = GGML_QUANT_SIZES[self.kind]
        self.register_buffer("blocks", blocks)  # [V, row bytes]
        self.num_embeddings, self.embedding_dim = blocks.shape[0], blocks.shape[1] // size * values

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        return self.expand(self.blocks[ids.reshape(-1)]).view(*ids.shape, self.embedding_dim)

    def expand(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of blocks ``[N, row bytes]`` as ``[N, H]`` values in ``dtype``."""
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(rows.numpy(), self.kind)).to(self.stored).to(self.dtype)

    def expands_to(self, table: torch.Tensor) -> bool:
        """Whether every :data:`CHECK_STRIDE`-th row, and the last, expands to ``table``'s (``[V, H]``, compared in
        its own dtype): a wrong tensor or another dequantization differs in nearly every row, and the whole
        table's check would add seconds to a load (2.3 s for the 1.5B target's)."""
        rows = torch.cat([torch.arange(0, self.num_embeddings, CHECK_STRIDE), torch.tensor([self.num_embeddings - 1])])
        return all(torch.equal(self.expand(self.blocks[part]).to(self.stored), table[part])
                   for part in rows.split(CHECK_ROWS))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind.name}, dtype={self.dtype}"


CHECK_STRIDE = 16  # GgufEmbedding.expands_to compares one row in this many (9,496 of the 1.5B target's 151,936)
CHECK_ROWS = 8192  # rows expanded at a time by GgufEmbedding.expands_to: 50 MB of float32 at 1,536 wide


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
