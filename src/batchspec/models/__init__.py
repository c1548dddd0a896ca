"""Models, loading only: presets, loading, which models a method needs (:class:`ModelChoice`), CPU kernels and the
loaded pair (:class:`ModelPair`). Which models batchspec supports is checked beside the engine
(:mod:`batchspec.model_checks`)."""

from batchspec.models.choice import ModelChoice, load_models
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
    "ModelChoice",
    "ModelPair",
    "PresetError",
    "PresetPaths",
    "cached_preset",
    "check_compatible",
    "default_cache_dir",
    "load_model",
    "load_models",
    "load_pair",
    "obtain_preset",
    "resolve_dtype",
    "use_kernels",
]
