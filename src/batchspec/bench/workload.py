"""What a benchmark or audit measures: the models, the prompts and the generation budget."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from batchspec.config import SpecConfig, setting_default
from batchspec.exact.integer import check_quantize


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and the budget every method is run with.

    Attributes:
        model: the pair's name for reports.
        dtype: the models' dtype name.
        prompt_source: where the prompts came from (``humaneval``, a path, ...).
        prompts: token ids of every prompt.
        max_new_tokens: new tokens per prompt at most.
        num_draft_tokens: drafts per round for the speculative methods, or ``"auto"``.
        eos_token_ids: ids that end a sequence.
        pad_token_id: filler for padded batches.
        kernels: the models' CPU matrix kernels (``packed`` or ``default``, see :func:`batchspec.models.use_kernels`).
        device: where the models run (``cpu``, or the GPU's name: see :func:`batchspec.devices.device_name`).
        quantize: ``"int8"`` when the models are the exact int8 ones (see :mod:`batchspec.exact.integer`), else
            ``"none"``.
        prefix_cache_size: batchspec's prefix cache in bytes, 0 or ``"auto"`` (it changes times, never outputs).
    """

    model: str
    dtype: str
    prompt_source: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    num_draft_tokens: int | str
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    kernels: str = "default"
    device: str = "cpu"
    quantize: str = "none"
    prefix_cache_size: int | str = setting_default("prefix_cache_size")

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a workload needs at least one prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        SpecConfig(num_draft_tokens=self.num_draft_tokens, prefix_cache_size=self.prefix_cache_size)  # their checks
        check_quantize(self.quantize)

    @property
    def key(self) -> str:
        """Identifies the workload's reference outputs (model, dtype, kernels, prompts, budget, EOS, the device
        when it is not the CPU and the quantization when there is one)."""
        fields: list[object] = [
            self.model, self.dtype, self.kernels, self.prompts, self.max_new_tokens, self.eos_token_ids
        ]
        if self.device != "cpu":
            fields.append(self.device)
        if self.quantize != "none":
            fields.append({"quantize": self.quantize})
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def machine_description() -> str:
    """``<cpu or gpu name>, <cores> cores, torch <version>`` for result rows."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else _cpu_name()
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
