"""Mistral: Llama's layers. Only configs without a sliding window run (``sliding_window`` None)."""

from batchspec.families.base import Family

FAMILY = Family("mistral", ("mistral",))
