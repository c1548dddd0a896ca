"""Qwen2 and Qwen2.5 (the presets): Llama's layers with a bias on the q, k and v products."""

from batchspec.families.base import Family

FAMILY = Family("qwen2", ("qwen2",))
