"""Models, loading only: presets and obtaining them (:mod:`batchspec.models.obtain`), loading, which models a method
needs (:class:`ModelChoice`), CPU kernels and the loaded pair (:class:`ModelPair`). Which models batchspec supports is
checked beside the engine (:mod:`batchspec.model_checks`). ``packing.py`` here is the float32 models' prepacked
oneDNN linear (``--kernels``); the exact modes' own kernels live in their rooms (``exact/integer/product.py``,
``exact/invariant/kernels.py``)."""

from batchspec.config import default_cache_dir
from batchspec.models.choice import ModelChoice, load_models
from batchspec.models.loading import check_compatible, load_model, load_pair, resolve_dtype, use_kernels
from batchspec.models.obtain import cached_preset, obtain_preset
from batchspec.models.obtain.catalogue import DEFAULT_PRESET, PRESETS, PresetError, PresetPaths
from batchspec.models.pair import ModelPair

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
