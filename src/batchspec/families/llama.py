"""Llama (and Vicuna, TinyLlama, the Llama 3 family): the layout the others are described against. Pre-norm layers,
RMSNorm, separate q, k, v and gate, up products, SiLU-gated MLP, rotary over every layer (default, linear, llama3 or
yarn scaling)."""

from batchspec.families.base import Family

FAMILY = Family("llama", ("llama",))
