"""Models, loading only: support checks, presets, loading, CPU kernels and the loaded pair (:class:`ModelPair`)."""

from batchspec.models.loading import check_compatible, load_model, load_pair, resolve_dtype, use_kernels
from batchspec.models.pair import ModelPair
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
    "ModelPair",
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
