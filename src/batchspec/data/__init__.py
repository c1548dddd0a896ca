"""Benchmark prompts: loading them from files or packages and formatting them into token ids."""

from batchspec.data.prompts import PromptRecord, format_prompts, load_prompts

__all__ = ["PromptRecord", "format_prompts", "load_prompts"]
