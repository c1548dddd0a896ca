"""Turning a loaded float model into the exact int8 model: which modules are swapped, and the checks before.

:func:`quantize_model` smooths the float model's activations (:mod:`~batchspec.int8.smoothing`), then
swaps, in place:

* every MLP for an :class:`~batchspec.int8.linear.Int8MLP` (its activation on torch's vector path only);
* every other ``nn.Linear`` (the output layer too) for an :class:`~batchspec.int8.linear.Int8Linear`; an
  attention's q, k and v projections share one quantization of their input, and its keys and values enter the KV
  cache quantized (:func:`~batchspec.int8.attention.pack_on_update`);
* every RMSNorm for :class:`ExactRMSNorm` (the mean of squares summed in a fixed order, :func:`row_sum`);
* the rotary embedding for :class:`RotaryTable` (cos/sin computed once per position, then looked up);
* the attention implementation for :data:`~batchspec.int8.attention.NAME`.

The token embedding stays as it is: a lookup copies a row. What is left between these modules is elementwise
(residual additions, the rotary products), so every row's logits are independent of the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from batchspec.int8 import attention, native
from batchspec.int8.arithmetic import row_sum
from batchspec.int8.linear import Int8Linear, Int8MLP, SharedQuantization
from batchspec.int8.smoothing import calibration_ids, smooth_model
from batchspec.layers import RMSNormSwap, is_rms_norm, swap_layers
from batchspec.model_checks import check_model

QUANTIZE: tuple[str, ...] = ("auto", "none", "int8")
# rotary kinds whose cos/sin depend on the position alone (not on the sequence length, as "dynamic" does)
STATIC_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


class ExactRMSNorm(RMSNormSwap):
    """RMSNorm with its mean of squares summed in an order fixed by the hidden size (:func:`exact_rms_norm`); in
    float32 on a CPU that runs batchspec's native kernels, :func:`~batchspec.int8.native.rms_norm` gives the same
    bits in one call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if x.dtype == self.weight.dtype == torch.float32 and native.available():
            return native.rms_norm(x, self.weight, self.eps)
        return exact_rms_norm(x, self.weight, self.eps)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x * x) + eps))`` over the last dimension (``[..., H]``), the mean summed by
    :func:`row_sum` and every other operation elementwise."""
    mean = row_sum(x * x) / x.shape[-1]  # [..., 1]
    return weight * (x * (1.0 / torch.sqrt(mean + eps)))


class RotaryTable(torch.nn.Module):
    """The model's own rotary embedding, computed once for every position and then looked up.

    transformers computes ``cos``/``sin`` of each forward's positions, and a value's result depends on where it
    sits in that forward's tensor (see :mod:`batchspec.int8.arithmetic`); a table built in one call gives
    position ``p`` the same values in every forward.
    """

    def __init__(self, rotary: torch.nn.Module, positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        probe = torch.zeros(1, dtype=dtype, device=rotary.inv_freq.device)
        with torch.no_grad():
            cos, sin = rotary(probe, torch.arange(positions, device=probe.device)[None])  # [1, P, D] each
        self.register_buffer("cos", cos[0].contiguous(), persistent=False)
        self.register_buffer("sin", sin[0].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)  # [B, S, D] each


def check_quantize(quantize: str) -> str:
    """``quantize`` when it is one of :data:`QUANTIZE`, else a ValueError naming them."""
    if quantize not in QUANTIZE:
        raise ValueError(f"Unsupported quantize {quantize!r}; expected one of {', '.join(QUANTIZE)}")
    return str(quantize)


def quantizable(model: Any) -> bool:
    """Whether :func:`quantize_model` can make ``model`` exact (see :func:`check_quantizable`)."""
    try:
        check_quantizable(model)
    except ValueError:
        return False
    return True


def check_quantizable(model: Any) -> None:
    """Raise ValueError naming what stands in the way unless :func:`quantize_model` can make ``model`` exact."""
    check_model(model, "int8")
    config = model.config
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        raise ValueError(f"--quantize int8 runs on the CPU; this model is on {parameter.device}")
    if parameter.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"--quantize int8 needs a float32 (or float64) model, not {parameter.dtype}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"--quantize int8 needs a SiLU MLP; this model uses {config.hidden_act!r}")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        raise ValueError(f"--quantize int8 needs a rotary embedding fixed per position, not {rope!r}")


def quantize_model(model: Any, tokenizer: Any | None = None) -> Any:
    """Make ``model`` the exact int8 model in place (see the module docstring) and return it; its activations are
    smoothed first (:mod:`~batchspec.int8.smoothing`), calibrated on text ``tokenizer`` encodes (seeded
    token ids without one)."""
    check_quantizable(model)
    smooth_model(model, calibration_ids(tokenizer, model.config.vocab_size))
    attention.register()
    config, dtype = model.config, next(model.parameters()).dtype
    swap_layers(model, lambda name, child: _replacement(name, child, config, dtype))
    for module in model.modules():
        projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(p, Int8Linear) for p in projections):
            shared = SharedQuantization(readers=len(projections))
            for projection in projections:
                projection.quantizer = shared
            module.register_forward_pre_hook(attention.pack_on_update, with_kwargs=True)
    model.config._attn_implementation = attention.NAME
    return model


def _replacement(name: str, child: torch.nn.Module, config: Any, dtype: torch.dtype) -> torch.nn.Module | None:
    if name == "mlp":
        return Int8MLP(child)
    if isinstance(child, torch.nn.Linear):
        return Int8Linear(child)
    if is_rms_norm(child):
        return ExactRMSNorm(child)
    if name == "rotary_emb":
        return RotaryTable(child, config.max_position_embeddings, dtype)
    return None


def quantization(model: Any) -> str:
    """``"int8"`` when :func:`quantize_model` made ``model``, else ``"none"``."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"
