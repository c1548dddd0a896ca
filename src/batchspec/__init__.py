"""batchspec: batch speculative decoding that is output-equivalent to plain autoregressive generation."""

from batchspec.api import GenerationResult, generate
from batchspec.config import SpecConfig
from batchspec.engine import GenerationStats
from batchspec.hf import hf_generate

__all__ = ["GenerationResult", "GenerationStats", "SpecConfig", "generate", "hf_generate"]
__version__ = "0.1.0"
