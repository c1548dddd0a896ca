"""The one type for a loaded target and draft: what the CLI, the benchmarks and the server work with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchspec.devices import device_name
from batchspec.engine import bridge_of
from batchspec.exact.integer import check_quantize, forward_in_use, native, quantization
from batchspec.exact.invariant import batch_invariant as is_batch_invariant
from batchspec.models.packing import kernels_in_use


@dataclass(frozen=True)
class ModelPair:
    """A target and a draft model in eval mode and the tokenizer they share.

    Attributes:
        target: the model whose greedy output is reproduced.
        draft: the draft model, or None when only the target was loaded (methods or proposers that need a
            draft model then cannot run).
        tokenizer: the target's tokenizer (the draft shares it, or carries its own: a draft of another tokenizer,
            :func:`~batchspec.engine.bridge_of`).
        name: what reports and the served ``/v1/models`` list call the pair.
        dtype: the name of the dtype both were loaded in (``"float32"``, ``"bfloat16"``, ...), resolved: never
            ``"auto"`` (see :func:`batchspec.models.resolve_dtype`).
        seconds: time spent loading them (0.0 when not measured).
        device: where they run, as reports name it (``cpu``, ``cuda:0 (NVIDIA H100 80GB HBM3)``; see
            :func:`batchspec.devices.device_name`).
        quantize: ``"int8"`` when both were made the exact int8 models (see :mod:`batchspec.exact.integer`: their
            ``dtype`` is then that of the activations and of what stays float), else ``"none"``.
        batch_invariant: whether both run on the batch-invariant kernels (see :mod:`batchspec.exact.invariant`).
        draft_quantize: what the load made of the draft (``"int4"``, ``"int8"``, ``"none"``; no draft: ``"none"``).
        build: the native build the integer forward runs on (:func:`batchspec.exact.integer.native.isa`), ``torch``
            without one, ``none`` for models that are not integer.
        through_text: the draft is of another tokenizer and drafts through text (:mod:`batchspec.engine`'s
            ``bridge_of``).
    """

    target: Any
    draft: Any | None
    tokenizer: Any
    name: str
    dtype: str
    seconds: float = 0.0
    device: str = "cpu"
    quantize: str = "none"
    batch_invariant: bool = False
    build: str = "none"
    forward: str = "transformers'"
    draft_quantize: str = "none"
    through_text: bool = False

    @classmethod
    def loaded(cls, target: Any, draft: Any | None, tokenizer: Any, name: str, dtype: str, device: torch.device,
               seconds: float) -> ModelPair:
        """The pair as loaded in ``dtype`` on ``device`` (a load's settings): the device's name, and what the load
        made of the target (its quantize mode, batch-invariant kernels and the native build it runs on) read once,
        here."""
        quantize = quantization(target)
        build = "none" if quantize == "none" else native.isa() if native.available() else "torch"
        forward = forward_in_use(target)
        if draft is not None and forward_in_use(draft) != forward:
            forward = f"{forward}; the draft's {forward_in_use(draft)}"
        return cls(target, draft, tokenizer, name, dtype, seconds, device_name(device), quantize,
                   is_batch_invariant(target), build, forward, "none" if draft is None else quantization(draft),
                   bridge_of(draft) is not None)

    def served(self) -> dict[str, str]:
        """What ``/v1/models`` says of how the pair runs: device, dtype, quantize mode, native build and forward."""
        return {"device": self.device, "dtype": self.dtype, "quantize": self.quantize, "build": self.build,
                "forward": self.forward, "draft_quantize": self.draft_quantize,
                "draft_tokenizer": "its own, through text" if self.through_text else "the target's"}

    @property
    def precision(self) -> str:
        """The dtype and CPU kernels the models run in, for summaries: ``float32, packed kernels``; on a GPU the
        dtype and the device: ``float32 on cuda:0 (NVIDIA H100 80GB HBM3)``, or ``bfloat16, batch-invariant on
        cuda:0 (...)``; quantized: ``float32, int8 exact on avx2`` (the native build the int8 forward runs on, see
        :func:`batchspec.exact.integer.native.isa`; ``torch`` without one) and the forward: ``float32, int8 exact on
        avx2, fused forward``, or ``transformers' forward (why not fused)``."""
        if self.device != "cpu":
            return f"{self.dtype}{', batch-invariant' if self.batch_invariant else ''} on {self.device}"
        if self.quantize != "none":
            draft = f", the draft {self.draft_quantize}" if self.draft_quantize not in ("none", self.quantize) else ""
            text = ", the draft through text" if self.through_text else ""
            return f"{self.dtype}, {self.quantize} exact on {self.build}{draft}, {self.forward} forward{text}"
        return f"{self.dtype}, {kernels_in_use(self.target)} kernels"

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            raise ValueError("dtype must be the one the models were loaded in, not 'auto' (see resolve_dtype)")
        if check_quantize(self.quantize) == "auto":
            raise ValueError("quantize must be what the models were made, not 'auto' (see resolve_quantize)")
