"""Qwen3: Llama's layers with an RMSNorm over each query and key head before the rotary embedding."""

from batchspec.families.base import Family

FAMILY = Family("qwen3", ("qwen3",))
