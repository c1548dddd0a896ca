"""Models: support checks, the per-batch runner, presets and loading."""

from batchspec.models.loading import (
    LoadedPair,
    check_compatible,
    load_model,
    load_pair,
    resolve_dtype,
    use_kernels,
)
from batchspec.models.presets import (
    DEFAULT_PRESET,
    PRESETS,
    PresetError,
    PresetPaths,
    cached_preset,
    default_cache_dir,
    obtain_preset,
)

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "LoadedPair",
    "PresetError",
    "PresetPaths",
    "cached_preset",
    "check_compatible",
    "default_cache_dir",
    "load_model",
    "load_pair",
    "obtain_preset",
    "resolve_dtype",
    "use_kernels",
]
