"""Turning a loaded float model into the exact integer model: which modules are swapped, and the checks before.

:func:`quantize_model` makes the int8 model (``width="int8"``) or the int4 one (``"int4"``). For int8 it smooths the
float model's activations (:mod:`~batchspec.exact.integer.smoothing`); int4's activations are quantized per super-block
instead (:mod:`~batchspec.exact.integer.int4`). Then it swaps, in place:

* every MLP for a :class:`~batchspec.exact.integer.linear.QuantizedMLP` (its activation
  :func:`~batchspec.exact.integer.arithmetic.exact_silu`, or Gemma's
  :func:`~batchspec.exact.integer.arithmetic.exact_gelu_tanh`, as the config names it);
* every other ``nn.Linear`` for an :class:`~batchspec.exact.integer.linear.Int8Linear` or, in int4, an
  :class:`~batchspec.exact.integer.linear.Int4Linear` (the output layer stays int8): a GGUF file's own 4-bit blocks
  where the model came from one (its other tensors int8), else the float weight rounded to int4; an attention's q,
  k and v projections share one quantization of their input, and its keys and values enter the KV cache quantized
  (:func:`~batchspec.exact.integer.attention.pack_on_update`);
* every RMSNorm for :class:`ExactRMSNorm` (the mean of squares summed in a fixed order, :func:`row_sum`); a family
  whose norms scale by ``1 + weight`` (Gemma's, :attr:`~batchspec.families.Plan.norm_offset`) has them swapped
  first, before the smoothing folds its scales into them, each holding ``1 + weight`` as its weight;
* the rotary embedding for :class:`~batchspec.exact.integer.rotary.RotaryTable` (frequencies, cos and sin correctly
  rounded, computed once per position, then looked up; one table per layer type where the model has them);
* the attention implementation for :data:`~batchspec.exact.integer.attention.NAME` (which soft-caps the scores
  exactly where the attention module passes a ``softcap``: Gemma 2's);
* a final logit soft-cap (Gemma 2's ``final_logit_softcapping``) moves from transformers' forward to the output
  layer's outputs, exactly (:func:`_cap_logits`).

Phi-3's and GLM-4's fused projections are split first (:func:`split_fused`), so that every step after sees a Llama's
q, k, v and gate, up layers; a mixture of experts' block is laid out as a router and experts of a Llama's layers
(:mod:`~batchspec.exact.integer.moe`), each expert then swapped for a ``QuantizedMLP``.

The token embedding keeps its values: a lookup copies a row (of a bfloat16 table widened, :class:`ExactEmbedding`, or
of a GGUF file's own blocks expanded, where the model came from one). What is left between these modules is elementwise
(residual additions, the rotary products), so every row's logits are independent of the batch; and since no value
depends on a float sum's order, a vector library's approximation or a BLAS, they are the same bits on every CPU and
with any number of threads. The smoothing's activation peaks come from the same exact model (unsmoothed), so the int8
weights are the same bits everywhere too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from batchspec.config import QUANTIZE, check_option
from batchspec.exact.integer import attention, native
from batchspec.exact.integer.arithmetic import ACTIVATIONS, exact_softcap, row_sum, sqrt_rounded
from batchspec.exact.integer.int4 import Int4Weight, from_float
from batchspec.exact.integer.linear import (
    Int4Linear,
    Int8Linear,
    IntLinear,
    QuantizedMLP,
    SharedQuantization,
)
from batchspec.exact.integer.moe import Expert, SparseMoE, split_experts
from batchspec.exact.integer.rotary import RotaryTable
from batchspec.exact.integer.smoothing import calibration_ids, calibration_peaks, decoder_layers, smooth_layer
from batchspec.exact.swap import RMSNormSwap, is_rms_norm, swap_layers
from batchspec.families import plan_of, positions_of
from batchspec.memory import give_back_freed_memory
from batchspec.model_checks import check_model

logger = logging.getLogger(__name__)

# rotary kinds whose cos/sin depend on the position alone (not on the sequence length, as "dynamic" does); LongRoPE's
# do up to its original_max_position_embeddings, the positions its table holds (batchspec.families.positions_of)
STATIC_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope")


class ExactRMSNorm(RMSNormSwap):
    """RMSNorm with its mean of squares summed in an order fixed by the hidden size (:func:`exact_rms_norm`); in
    float32 on a CPU that runs batchspec's native kernels, :func:`~batchspec.exact.integer.native.rms_norm` gives the
    same
    bits in one call.

    :meth:`offset` makes one of a norm that scales by ``offset + weight`` (Gemma's ``(1.0 + w.float())``): its
    weight is ``offset + weight`` rounded once, which is the factor that norm computes on every call, so the output is
    ``(offset + w) * normed``, the product it forms (a product's bits do not depend on its operands' order)."""

    @classmethod
    def offset(cls, norm: torch.nn.Module, offset: float) -> ExactRMSNorm:
        """The exact norm of ``norm``, which scales by ``offset + norm.weight``."""
        made = cls(norm)
        made.weight = torch.nn.Parameter(norm.weight.detach() + offset, requires_grad=False)
        return made

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if x.dtype == self.weight.dtype == torch.float32 and native.available():
            return native.rms_norm(x, self.weight, self.eps)
        return exact_rms_norm(x, self.weight, self.eps)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x * x) + eps))`` over the last dimension (``[..., H]``), the mean summed by
    :func:`row_sum`, the root correctly rounded (:func:`sqrt_rounded`) and every other operation elementwise."""
    mean = row_sum(x * x) / x.shape[-1]  # [..., 1]
    return weight * (x * (1.0 / sqrt_rounded(mean + eps)))


def check_quantize(quantize: str) -> str:
    """``quantize`` when it is one of :data:`~batchspec.config.QUANTIZE`, else a ValueError naming them."""
    return check_option("quantize", quantize, QUANTIZE)


def cpu_default() -> str:
    """What ``--quantize auto`` makes float32 models on this CPU before it knows where they came from: ``"int8"``
    where a SIMD build of the kernels runs (:func:`~batchspec.exact.integer.native.isa`: on each of them the int8
    forward reads a prompt and decodes at least as fast as float32, docs/integer.md), else ``"none"``: on the builds
    of :data:`FLOAT32_FIRST` (the portable one: its int8 forward decodes faster than float32 but reads prompts
    slower) and without any build (no C compiler, ``BATCHSPEC_CPU_ISA=none``: the forward runs in torch, exact but
    several times slower than float32; :func:`width_for` may then make int8 int4). Says which and why in one log line,
    once per process and build."""
    isa, runs = native.isa(), native.available()
    choice = "int8" if runs and isa not in FLOAT32_FIRST else "none"
    if isa not in _SAID:
        _SAID.add(isa)
        if choice == "int8":
            logger.info("batchspec: --quantize auto: int8 (batchspec's %s kernels run here)", isa)
        elif runs:
            logger.info("batchspec: --quantize auto: float32 (batchspec's %s kernels run here, but their int8 forward "
                        "read prompts slower than float32, docs/integer.md; --quantize int8 runs it, exact)", isa)
        else:
            logger.warning("batchspec: --quantize auto: float32 (no native int8 kernels here (%s); --quantize int8 "
                           "runs the int8 forward in torch, exact but slow)", isa)
    return choice


_SAID: set[str] = set()  # the builds cpu_default has named in its log line

# builds whose int8 forward was measured slower than float32 at reading a prompt (docs/integer.md, "The portable
# build": smollm2, 128 tokens, 763 against 239 ms; a one-token step 26 against 49 ms): --quantize auto loads float32
FLOAT32_FIRST: tuple[str, ...] = ("portable",)

# builds on which int4 was measured faster than int8 in every cell (docs/integer.md, "Which width"): without VNNI the
# int8 product's prompt reading and verifications are bound by 256-bit vpmaddwd, and int4's by half as many bytes
INT4_FIRST: tuple[str, ...] = ("avx2",)


def width_for(four_bit: bool) -> str:
    """The width ``--quantize auto`` gives models that the integer forward supports: ``"int4"`` where they came from
    files that hold their weights in 4 bits (``four_bit``: the models as published) and the build in use is one of
    :data:`INT4_FIRST`, else ``"int8"``. On the VNNI builds int8 read prompts and verified drafts faster than int4 (a
    plain B = 1 step was faster in int4), so it stays their default; ``--quantize int4`` asks for int4 anywhere. Says
    which and why in one log line."""
    if not four_bit:
        return "int8"
    isa = native.isa()
    if isa in INT4_FIRST:
        logger.info("batchspec: --quantize auto: int4 (the files hold 4-bit weights, kept as they are; on the %s "
                    "build int4 was faster than int8 in every measured cell)", isa)
        return "int4"
    logger.info("batchspec: --quantize auto: int8 (the files hold 4-bit weights, but on the %s build int8 reads "
                "prompts and verifies drafts faster; --quantize int4 keeps the files' own blocks)", isa)
    return "int8"


def quantizable(model: Any) -> bool:
    """Whether :func:`quantize_model` can make ``model`` exact (see :func:`check_quantizable`)."""
    try:
        check_quantizable(model)
    except ValueError:
        return False
    return True


def check_quantizable(model: Any, width: str = "int8") -> None:
    """Raise ValueError naming what stands in the way unless :func:`quantize_model` can make ``model`` exact in
    ``width``: a CPU model held in float32, bfloat16 or float16 (computed in float32), or for int8 in float64."""
    check_model(model, width)
    config = model.config
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        raise ValueError(f"--quantize {width} runs on the CPU; this model is on {parameter.device}")
    held = {t.dtype for t in model.parameters() if t.is_floating_point()}
    if not held <= set(STORED_DTYPES) and not (width == "int8" and held == {torch.float64}):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
        raise ValueError(f"--quantize {width} needs a float32 model (or one held in bfloat16 or float16), not {names}")
    activation = mlp_activation(config)
    if activation not in ACTIVATIONS:
        raise ValueError(f"--quantize {width} needs an MLP activation among {sorted(ACTIVATIONS)}; this model uses "
                         f"{activation!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    by_type = [value for value in rope.values() if isinstance(value, dict)]  # a table per layer type (Gemma 3)
    for parameters in by_type or [rope]:
        kind = parameters.get("rope_type", "default")
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(f"--quantize {width} needs a rotary embedding fixed per position, not {kind!r}")


def mlp_activation(config: Any) -> str:
    """The name of the MLP activation of a model of ``config`` (``hidden_activation`` where the config has one, as
    Gemma's do, else ``hidden_act``; ``silu`` where it names none)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


# the dtypes a model may hold its weights in for quantize_model, which computes in float32 (float64 models: float64)
STORED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

class WeightSource(Protocol):
    """Where a model's weights came from, for what the integer model keeps as its file holds it (a GGUF file's:
    :class:`batchspec.models.gguf_weights.GgufWeights`)."""

    def int4(self, name: str) -> Int4Weight | None:
        """Linear layer ``name``'s own int4 weight, or None where the file holds that weight otherwise."""

    def embedding(self, name: str, table: torch.Tensor, dtype: torch.dtype) -> torch.nn.Module | None:
        """The input embedding ``name`` (loaded ``table`` ``[V, H]``) held more compactly, its rows looked up as
        ``table``'s values in ``dtype``; or None."""


Maker = Callable[[str, torch.nn.Linear], IntLinear]
# a parameter's values by its qualified name (its rows ``[part]`` where given), read afresh into memory of its own
# where it maps a file
Fresh = Callable[..., torch.Tensor]


def quantize_model(model: Any, tokenizer: Any | None = None, width: str = "int8",
                   source: WeightSource | None = None, fresh: Fresh | None = None, *, round_rest: bool = False) -> Any:
    """Make ``model`` the exact integer model of ``width`` in place (see the module docstring) and return it.

    int8: the activations are smoothed first (:mod:`~batchspec.exact.integer.smoothing`), with peaks from the exact
    int8 model's own decoder before smoothing, run on text ``tokenizer`` encodes (seeded token ids without one): a
    forward whose every value is the same bits on every CPU, where the float model's would depend on its BLAS and
    thread count. int4: ``source`` gives each linear layer's own int4 weight where the model came from a file that
    holds them (None: that layer is int8, or with ``round_rest``, a draft's, rounded to int4 too); without a source
    every linear layer but the output is rounded to int4.
    Either width keeps ``source``'s form of the input embedding where it gives one.

    A model held in bfloat16 or float16 is computed in float32 (float64 models in float64): its norms and biases are
    widened at once, its input embedding keeps its dtype and widens the rows it looks up (:class:`ExactEmbedding`,
    the same values), and each decoder layer's weights are widened only while that layer is smoothed and quantized,
    so no float32 copy of the whole model is ever held. The integer weights are the same bits as those of the model
    widened first. ``fresh`` reads each weight when it is used (from a checkpoint file, into memory of its own: see
    :class:`batchspec.models.checkpoint.CheckpointReader`), so a lazily loaded model's file mapping never becomes
    resident as a whole."""
    check_quantizable(model, width)
    split_fused(model)
    attention.register()
    compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    fresh = fresh or _as_held
    _widen_the_rest(model, compute, fresh, source)
    plan = plan_of(model.config)
    if plan.norm_offset:
        offset = plan.norm_offset
        swap_layers(model, lambda name, child: ExactRMSNorm.offset(child, offset) if is_rms_norm(child) else None)
    peaks = _calibration(model, tokenizer, compute, fresh) if width == "int8" else None
    make = _int8_maker(compute, fresh) if width == "int8" else _int4_maker(source, compute, fresh, round_rest)
    for name, layer in _named_layers(model):
        if peaks is not None:
            _widen_linears(layer, name, compute, fresh)
            smooth_layer(layer, peaks[layer], plan.norms.after)
        _swap(layer, make, compute, head=True, prefix=f"{name}.")
        give_back_freed_memory()  # the layer's widened weights, so that the heap does not grow layer by layer
    _swap(model, make, compute, head=True)
    _share_inputs(model)
    _cap_logits(model)
    return model


def _cap_logits(model: Any) -> None:
    """Gemma 2's ``final_logit_softcapping`` taken over from transformers' forward, which soft-caps the logits with
    ``torch.tanh`` (whose bits depend on where a value sits in the tensor): the config's cap is cleared and the output
    layer's own outputs capped by :func:`~batchspec.exact.integer.arithmetic.exact_softcap` (a forward hook), so
    transformers' forward of the integer model and the fused forward (which calls the same output layer) give the
    same bits."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is None:
        return
    model.config.final_logit_softcapping = None
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: exact_softcap(out, float(cap)))


def split_fused(model: Any) -> None:
    """Lay ``model``'s fused projections out as a Llama's, in place: each MLP whose gate and up projections are one
    weight (``gate_up_proj``: Phi-3's, GLM-4's) becomes a :class:`GatedMLP` of its two halves, and each attention
    whose q, k and v are one (``qkv_proj``: Phi-3's) gets them as ``q_proj``, ``k_proj`` and ``v_proj`` of its rows,
    its ``qkv_proj`` then their outputs side by side (:class:`JoinedProjection`). Every output keeps its channel's
    weights, so the integer model made from the layers split has the bits of one made from the fused weights; the
    smoothing, the swap and the fused forward see a Llama's layers. A mixture of experts' block (3-D expert weights:
    Qwen3-MoE's, OLMoE's, Mixtral's) becomes a :class:`~batchspec.exact.integer.moe.SparseMoE`, its router and each
    expert linear layers of views of those weights (:func:`~batchspec.exact.integer.moe.split_experts`), which the
    swap then quantizes one expert at a time."""
    split_experts(model, mlp_activation(model.config))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(getattr(child, "gate_up_proj", None), torch.nn.Linear):
                setattr(module, name, GatedMLP(child))
        if isinstance(getattr(module, "qkv_proj", None), torch.nn.Linear):
            _split_qkv(module)


def _rows(linear: torch.nn.Linear, part: slice) -> torch.nn.Linear:
    """A linear layer of ``linear``'s output channels ``part`` (its weight a view of their rows)."""
    weight = linear.weight.detach()[part]  # [R, K]
    made = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
    made.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        made.bias = torch.nn.Parameter(linear.bias.detach()[part], requires_grad=False)
    return made


class GatedMLP(torch.nn.Module):
    """An MLP whose gate and up projections were one weight (``gate_up_proj``, gate's rows first, as Phi-3's and
    GLM-4's ``chunk(2)`` reads them) as a Llama's: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the fused
    weight's two halves its ``gate_proj`` and ``up_proj``."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        fused = mlp.gate_up_proj
        half = fused.out_features // 2
        if fused.out_features != 2 * half:
            raise ValueError(f"{type(mlp).__name__}'s gate_up_proj has an odd number of outputs ({fused.out_features})")
        self.gate_proj, self.up_proj = _rows(fused, slice(0, half)), _rows(fused, slice(half, None))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.activation_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _split_qkv(attention: torch.nn.Module) -> None:
    """``attention``'s ``qkv_proj`` (rows: q's, then k's, then v's) as its ``q_proj``, ``k_proj`` and ``v_proj``."""
    fused, size = attention.qkv_proj, attention.head_dim
    queries, keys = attention.config.num_attention_heads * size, attention.config.num_key_value_heads * size
    if fused.out_features != queries + 2 * keys:
        raise ValueError(f"{type(attention).__name__}'s qkv_proj has {fused.out_features} outputs, not q's {queries} "
                         f"and k's and v's {keys} each")
    del attention.qkv_proj
    attention.q_proj = _rows(fused, slice(0, queries))
    attention.k_proj = _rows(fused, slice(queries, queries + keys))
    attention.v_proj = _rows(fused, slice(queries + keys, None))
    attention.qkv_proj = JoinedProjection(attention)


class JoinedProjection:
    """What an attention whose q, k and v were one layer (Phi-3's ``qkv_proj``) calls in its place: its own
    ``q_proj``, ``k_proj`` and ``v_proj`` (looked up at each call: the integer layers once swapped in), their outputs
    side by side, ``[..., K] -> [..., Q + 2 Kv]``. Not a module: the attention's parts are the three layers alone, as
    a Llama's are."""

    def __init__(self, owner: torch.nn.Module) -> None:
        self.owner = owner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        return torch.cat([owner.q_proj(x), owner.k_proj(x), owner.v_proj(x)], dim=-1)


def _named_layers(model: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, layer)`` of each of ``model``'s decoder layers, in order."""
    layers = {id(layer) for layer in decoder_layers(model)}
    return [(name, module) for name, module in model.named_modules() if id(module) in layers]


def _as_held(name: str, tensor: torch.Tensor, part: slice | None = None) -> torch.Tensor:
    return tensor if part is None else tensor[part]


def _calibration(model: Any, tokenizer: Any | None, compute: torch.dtype, fresh: Fresh) -> dict[torch.nn.Module, dict]:
    """:func:`calibration_peaks` of the exact int8 model before smoothing (swapped in, then out again)."""
    ids = calibration_ids(tokenizer, model.config.vocab_size)[: positions_of(model.config)]  # the table's
    make, replaced = _int8_maker(compute, fresh), []
    for name, layer in _named_layers(model):
        replaced += _swap(layer, make, compute, head=False, prefix=f"{name}.")
        give_back_freed_memory()  # the layer's read buffers
    replaced += _swap(model, make, compute, head=False)
    restore = _share_inputs(model)
    try:
        return calibration_peaks(model, ids)
    finally:
        restore()
        for parent, name, child in reversed(replaced):
            setattr(parent, name, child)


def _int8_maker(compute: torch.dtype, fresh: Fresh) -> Maker:
    def make(name: str, linear: torch.nn.Linear) -> IntLinear:
        return _int8_layer(name, linear, compute, fresh)

    return make


def _int8_layer(name: str, linear: torch.nn.Linear, compute: torch.dtype, fresh: Fresh) -> Int8Linear:
    """``linear`` (module ``name``) as an :class:`Int8Linear` of its weight read through ``fresh`` a part of its
    output channels at a time (:func:`~batchspec.exact.integer.linear.quantized_weight`)."""
    weight = linear.weight.detach()
    return Int8Linear(linear, lambda part: fresh(f"{name}.weight", weight, part), compute)


def _int4_maker(source: WeightSource | None, compute: torch.dtype, fresh: Fresh, round_rest: bool = False) -> Maker:
    """The layer ``--quantize int4`` makes of the linear layer ``name``: the output layer int8; else ``source``'s
    int4 weight, where it has none int8 (or with ``round_rest`` the float weight rounded to int4), or without a
    source the float weight rounded to int4."""

    def make(name: str, linear: torch.nn.Linear) -> IntLinear:
        weight = None
        if name.split(".")[-1] != "lm_head":
            weight = None if source is None else source.int4(name)
            if weight is None and (source is None or round_rest):
                weight = from_float(fresh(f"{name}.weight", linear.weight))
        if weight is not None:
            return Int4Linear(weight, linear.bias)
        return _int8_layer(name, linear, compute, fresh)

    return make


def _widen_linears(layer: torch.nn.Module, prefix: str, compute: torch.dtype, fresh: Fresh) -> None:
    """The weights of ``layer``'s linear layers (named from ``prefix``) read afresh and in the ``compute`` dtype, for
    good (the smoothing scales them)."""
    for name, module in layer.named_modules(prefix=prefix):
        if isinstance(module, torch.nn.Linear):
            module.weight.data = fresh(f"{name}.weight", module.weight.data).to(compute)


def _widen_the_rest(model: Any, compute: torch.dtype, fresh: Fresh, source: WeightSource | None) -> None:
    """Every floating tensor of ``model`` but the linear layers' weights read afresh and in the ``compute`` dtype
    (norms, biases, tables); the input embedding read afresh and held as ``source`` holds it where it does, else,
    where it is held in another dtype, as an :class:`ExactEmbedding` of its table."""
    decoder, names = model.get_decoder(), {id(m): name for name, m in model.named_modules()}
    embedding, module_name = decoder.embed_tokens, names[id(decoder.embed_tokens)]
    table = fresh(f"{module_name}.weight", embedding.weight.detach())  # [V, H]
    scale = getattr(embedding, "embed_scale", None)  # Gemma's: its rows are multiplied by it
    compact = None if source is None or scale is not None else source.embedding(module_name, table, compute)
    if compact is not None:
        decoder.embed_tokens = compact
    elif table.dtype != compute:
        decoder.embed_tokens = ExactEmbedding(table, compute, scale)
    else:
        embedding.weight.data = table
    for prefix, module in model.named_modules():
        if module is decoder.embed_tokens or module is embedding:
            continue
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            linear_weight = isinstance(module, torch.nn.Linear) and name == "weight"
            if tensor.is_floating_point() and not linear_weight:
                tensor.data = fresh(f"{prefix}.{name}" if prefix else name, tensor.data).to(compute)


class ExactEmbedding(torch.nn.Module):
    """A token embedding whose table stays in the dtype it was loaded in (a bfloat16 checkpoint's: half of float32's
    memory) and whose rows widen to ``dtype`` as they are looked up: the same values as a widened table's rows, for
    every id (a widening is exact). With ``scale`` (Gemma's ``embed_scale``, a 0-d tensor) the rows are multiplied by
    it in ``dtype``, as the scaled embedding of the widened table multiplies them."""

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", table)  # [V, H]
        self.register_buffer("scale", None if scale is None else scale.detach().to(dtype), persistent=False)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        rows = torch.nn.functional.embedding(ids, self.weight).to(self.dtype)  # [..., H]
        return rows if self.scale is None else rows * self.scale


def _swap(root: torch.nn.Module, make: Maker, compute: torch.dtype, head: bool,
          prefix: str = "") -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Swap the exact modules into ``root`` in place (named from ``prefix``; the output layer too where ``head``; what
    is exact already is left), each linear layer as ``make(qualified name, layer)`` makes it; returns what was
    replaced (setting it back in reverse undoes the swap)."""
    config = getattr(root, "config", None)
    positions = positions_of(config) if config is not None else 0
    return swap_layers(root, lambda name, child: _replacement(name, child, positions, compute, head, make), prefix)


def _share_inputs(model: Any) -> Callable[[], None]:
    """Give each attention whose q, k and v are integer layers one shared quantization of its input, and its keys and
    values their way into the KV cache quantized; the model's attention implementation is the exact one. Returns what
    undoes it."""
    hooks = []
    for module in model.modules():
        projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(p, Int8Linear | Int4Linear) for p in projections):
            shared = SharedQuantization(readers=len(projections))
            for projection in projections:
                projection.quantizer = shared
            hooks.append(module.register_forward_pre_hook(attention.pack_on_update, with_kwargs=True))
    implementation, model.config._attn_implementation = model.config._attn_implementation, attention.NAME

    def restore() -> None:
        for hook in hooks:
            hook.remove()
        model.config._attn_implementation = implementation

    return restore


EXACT_MODULES = (QuantizedMLP, Int8Linear, Int4Linear)


def _replacement(name: str, child: torch.nn.Module, positions: int, dtype: torch.dtype, head: bool,
                 make: Maker) -> torch.nn.Module | None:
    part = name.split(".")[-1]
    if isinstance(child, EXACT_MODULES + (ExactRMSNorm, RotaryTable, ExactEmbedding)):
        return None
    if part == "lm_head" and not head:
        return None
    if isinstance(child, SparseMoE):
        return None
    if isinstance(child, Expert) or part == "mlp":
        linears = (make(f"{name}.{p}", getattr(child, p)) for p in ("gate_proj", "up_proj", "down_proj"))
        return QuantizedMLP(*linears, activation=_activation_of(child))
    if isinstance(child, torch.nn.Linear):
        return make(name, child)
    if is_rms_norm(child):
        return ExactRMSNorm(child)
    if part == "rotary_emb" and positions:
        return RotaryTable(child, positions, dtype)
    return None


def _activation_of(mlp: torch.nn.Module) -> str:
    """The activation (transformers' name) of a gated MLP: an expert's own, else its config's (SiLU without one)."""
    if isinstance(mlp, Expert):
        return mlp.activation
    config = getattr(mlp, "config", None)
    return mlp_activation(config) if config is not None else "silu"


def quantization(model: Any) -> str:
    """``"int4"`` or ``"int8"`` when :func:`quantize_model` made ``model`` so, else ``"none"``."""
    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "none"
