"""SmoothQuant-style smoothing: moving activation outliers into the weights before quantizing.

Quantizing a token's activations per token gives every channel the step ``max|x| / 127``; a few channels with
outliers (as in Qwen2.5's MLP) set that step and leave the other channels a handful of levels. For a linear layer
``y = W x`` and per-input-channel factors ``s``, ``y = (W diag(s)) (x / s)``: dividing the activations by ``s``
and multiplying the weight's columns by ``s`` leaves the float model's function unchanged and evens out the
channels (``s_j = max|x_j|**alpha / max|W[:, j]|**(1 - alpha)``, SmoothQuant's rule, with ``alpha = 0.5``).
The division is folded into what produces the activations, so it costs nothing at run time:

* the attention's and the MLP's inputs: into the RMSNorm weight before them (q/k/v and gate/up share one ``s``);
* the MLP's down projection: into the rows of the up projection (``silu(gate) * up`` is linear in ``up``).

``max|x_j|`` comes from one forward of the float model over :data:`CALIBRATION_TEXT` (code and prose written for
this purpose, so no benchmark's prompts are seen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ALPHA = 0.5
CALIBRATION_TEXT = """\
def merge_intervals(intervals):
    \"\"\"Merge overlapping intervals given as (start, end) pairs and return them sorted.\"\"\"
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], end))
        else:
            result.append((start, end))
    return result


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

The river rose slowly through the night, and by morning the lower fields were under water. Farmers moved their
animals to the ridge, where the old road still ran dry, and children carried sandbags from the mill. Nobody
remembered a flood this early in the spring; the snow had melted in a week of warm rain.

To compute the average of a list of numbers, add them and divide by how many there are: for 3, 5 and 10 the sum
is 18 and the average is 6. A median is the middle value once the numbers are sorted.
"""


def calibration_ids(tokenizer: Any | None, vocab_size: int) -> list[int]:
    """Token ids of :data:`CALIBRATION_TEXT` (``tokenizer``), or 256 seeded ids from the vocabulary without one."""
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (256,), generator=generator).tolist()


def smooth_model(model: Any, ids: list[int]) -> int:
    """Smooth every decoder layer of the float ``model`` in place from one forward over ``ids``; returns how many
    linear layers were rescaled."""
    layers = [m for m in model.modules() if all(hasattr(m, n) for n in ("self_attn", "mlp", "input_layernorm"))]
    peaks: dict[torch.nn.Module, torch.Tensor] = {}
    hooks = []
    for layer in layers:
        for linear in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
            hooks.append(linear.register_forward_pre_hook(_recorder(peaks, linear)))
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            _fold(peaks[attn.q_proj], [attn.q_proj, attn.k_proj, attn.v_proj], _divide_norm(layer.input_layernorm))
            _fold(peaks[mlp.gate_proj], [mlp.gate_proj, mlp.up_proj], _divide_norm(layer.post_attention_layernorm))
            _fold(peaks[mlp.down_proj], [mlp.down_proj], _divide_rows(mlp.up_proj))
    return 6 * len(layers)


def _recorder(peaks: dict, linear: torch.nn.Module) -> Callable:
    def record(module: torch.nn.Module, args: tuple) -> None:
        peak = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)  # [in]
        peaks[linear] = peak if linear not in peaks else torch.maximum(peaks[linear], peak)

    return record


def _fold(peak: torch.Tensor, linears: list[torch.nn.Module], divide: Callable[[torch.Tensor], None]) -> None:
    """Multiply the columns of ``linears`` by ``s`` and divide their input by ``s`` (through ``divide``)."""
    weight_peak = torch.stack([linear.weight.abs().amax(0) for linear in linears]).amax(0)  # [in]
    factor = peak.clamp(min=1e-5).pow(ALPHA) / weight_peak.clamp(min=1e-5).pow(1 - ALPHA)  # [in]
    factor = factor.to(linears[0].weight.dtype)
    for linear in linears:
        linear.weight.mul_(factor[None, :])
    divide(factor)


def _divide_norm(norm: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    return lambda factor: norm.weight.div_(factor)


def _divide_rows(linear: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    def divide(factor: torch.Tensor) -> None:
        linear.weight.div_(factor[:, None])
        if linear.bias is not None:
            linear.bias.div_(factor)

    return divide
