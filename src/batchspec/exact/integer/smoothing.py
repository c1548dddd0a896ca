"""SmoothQuant-style smoothing: moving activation outliers into the weights before quantizing.

Quantizing a token's activations per token gives every channel the step ``max|x| / 127``; a few channels with
outliers (as in Qwen2.5's MLP) set that step and leave the other channels a handful of levels. For a linear layer
``y = W x`` and per-input-channel factors ``s``, ``y = (W diag(s)) (x / s)``: dividing the activations by ``s``
and multiplying the weight's columns by ``s`` leaves the float model's function unchanged and evens out the
channels (``s_j = max|x_j|**alpha / max|W[:, j]|**(1 - alpha)``, SmoothQuant's rule, with ``alpha = 0.5``).
The division is folded into what produces the activations, so it costs nothing at run time:

* the attention's and the MLP's inputs: into the RMSNorm weight before them (q/k/v and gate/up share one ``s``);
* the MLP's down projection: into the rows of the up projection (``silu(gate) * up`` is linear in ``up``).

``max|x_j|`` comes from one forward of a model's decoder over :data:`CALIBRATION_TEXT` (code and prose written for
this purpose, so no benchmark's prompts are seen): :func:`~batchspec.exact.integer.model.quantize_model` runs it on the
exact int8 model before smoothing, so the peaks, the factors (correctly rounded roots and a quotient) and the smoothed
weights are the same bits on every CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchspec.exact.integer.arithmetic import sqrt_rounded

ALPHA = 0.5  # the square roots of _fold
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


# a decoder layer's three smoothed inputs: its attention's (q, k and v), its MLP's (gate and up), its down projection's
INPUTS: tuple[str, ...] = ("attention", "mlp", "down")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers (modules with ``self_attn``, ``mlp`` and ``input_layernorm``), in order."""
    return [m for m in model.modules() if all(hasattr(m, n) for n in ("self_attn", "mlp", "input_layernorm"))]


def calibration_peaks(model: Any, ids: list[int]) -> dict[torch.nn.Module, dict[str, torch.Tensor]]:
    """For each decoder layer, ``max |x_j|`` over the tokens ``ids`` of each of its :data:`INPUTS` (``[in]`` each),
    from one forward of the model's decoder (the output layer does not run)."""
    peaks: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
    hooks = []
    for layer in decoder_layers(model):
        peaks[layer] = {}
        readers = [layer.self_attn.q_proj, *((layer.mlp, layer.mlp.down_proj) if _dense(layer) else ())]
        for name, reader in zip(INPUTS, readers, strict=False):  # a mixture of experts': the attention's alone
            hooks.append(reader.register_forward_pre_hook(_recorder(peaks[layer], name)))
    try:
        with torch.no_grad():
            model.get_decoder()(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return peaks


def smooth_layer(layer: torch.nn.Module, peak: dict[str, torch.Tensor],
                 after: str = "post_attention_layernorm") -> None:
    """Smooth one decoder layer of a float model in place with its :func:`calibration_peaks` (``peak``): its
    attention's and MLP's inputs, folded into the norms before them (``input_layernorm``, and the norm named ``after``:
    its family's :attr:`~batchspec.families.Norms.after`, Gemma's ``pre_feedforward_layernorm``), and its down
    projection's, folded into the up projection's rows. A mixture of experts' MLP (no ``down_proj`` of its own) is
    left as it is: its attention alone is smoothed."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        _fold(peak["attention"], [attn.q_proj, attn.k_proj, attn.v_proj], _divide_norm(layer.input_layernorm))
        if not _dense(layer):
            return
        _fold(peak["mlp"], [mlp.gate_proj, mlp.up_proj], _divide_norm(getattr(layer, after)))
        _fold(peak["down"], [mlp.down_proj], _divide_rows(mlp.up_proj))


def _dense(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s MLP is one gated MLP (a Llama's), not a mixture of experts."""
    return hasattr(layer.mlp, "down_proj")


def _recorder(peaks: dict[str, torch.Tensor], name: str) -> Callable:
    def record(module: torch.nn.Module, args: tuple) -> None:
        peak = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)  # [in]
        peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)

    return record


def _fold(peak: torch.Tensor, linears: list[torch.nn.Module], divide: Callable[[torch.Tensor], None]) -> None:
    """Multiply the columns of ``linears`` by ``s`` and divide their input by ``s`` (through ``divide``):
    ``s = sqrt(peak) / sqrt(weight peak)`` (``ALPHA = 0.5``), each root correctly rounded, in the weight's dtype."""
    dtype = linears[0].weight.dtype
    weight_peak = torch.stack([linear.weight.abs().amax(0) for linear in linears]).amax(0)  # [in]
    activation = sqrt_rounded(peak.to(dtype).clamp(min=1e-5))  # [in]
    factor = activation / sqrt_rounded(weight_peak.clamp(min=1e-5))  # [in]
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
