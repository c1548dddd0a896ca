"""The exact integer model's forward as batchspec runs it: every decoder layer in one native call.

transformers' decoder layer, run around the integer modules (:mod:`batchspec.exact.integer.model`), spends more of a
one-token step in Python and torch's operations than in the products; so does calling the native functions from
Python one at a time (ctypes' conversions and the checks of ~12 calls a layer; the figures are in docs/integer.md,
"Speed"). So :class:`IntegerForward` hands the whole stack of layers to ``csrc/decoder.h`` in one call, each layer's
constant parts laid out once (:mod:`batchspec.exact.integer.plan`) and the forward's buffers made once and shared by
the layers::

    rows = quantize(RMSNorm(x))                        # norm_quantize: the norm never written out
    q, k, v = one product of rows                      # a stack: q, k, v's weights in one buffer
    query = rotary(q); cache[.., start:end] = pack(rotary(k)), pack(v)   # rotary_into: [B, H, S, D], int16 in place
    x = x + o(quantize(exact_attention(query, cache[.., :end])))        # the residual added in the product
    gate, up = one product of quantize(RMSNorm(x))
    x = x + down(quantize(act(gate) * up))             # quantize_gated: exact_silu (or GELU), never written out

A mixture of experts' layer (:mod:`batchspec.exact.integer.moe`) runs its router, each row's experts and their sum by
rank in place of the last two lines (``decoder.h``'s ``mixture``), and marks the experts it ran in each block's
``touched``, as transformers' forward of the block does.

Padding (a position that sees no key) is left out of every product, norm and quantization (:class:`_Rows`): only the
attention sees the ``[B, S]`` layout, the padding's keys and values written as zeros, which no query sees. Every
value of the other positions is computed by the operation transformers' forward of the integer model runs for it,
rounded the same way (``rotary_into`` is ``apply_rotary_pos_emb``'s products and sum, then the cache's packing; an
addition is the same whichever operand comes first), so their logits and KV cache are the same bits; that forward
stays the reference the tests compare this one with. It runs where the native kernels do, on float32 models of the
families batchspec runs (:mod:`batchspec.families`: each layer as its family's plan says) whose products all run on
them (:meth:`IntegerForward.of`); elsewhere the runner calls the model.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from batchspec.exact.integer import native, plan
from batchspec.exact.integer.arithmetic import ACTIVATIONS, EXP2_COEFFICIENTS
from batchspec.exact.integer.attention import QKV_LEVELS, QUERY_CHUNK, packed_width
from batchspec.exact.integer.linear import (
    Int4Linear,
    Int4Stack,
    Int8Linear,
    Int8Stack,
    IntLinear,
    QuantizedMLP,
)
from batchspec.exact.integer.model import ExactRMSNorm
from batchspec.exact.integer.moe import SparseMoE
from batchspec.exact.integer.rotary import RotaryTable
from batchspec.families import FULL, SLIDING, Norms, Plan, plan_of, sliding_visible
from batchspec.memory import give_back_freed_memory

logger = logging.getLogger(__name__)

Stack = Int8Stack | Int4Stack
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> IntegerForward | None
_BUILDING = threading.Lock()  # held while a forward is made: making one restacks the model's weights in place
UNREACHED = -1e30  # the logit of a token past a draft's vocabulary: finite, so that a softmax over tokens a grammar
# leaves that all lie past it is still a distribution (uniform), and far below any logit a model gives


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules: its norms by where they sit, the attention's products and (Qwen3, OLMo 2) query and
    key norms, the MLP's; q, k and v, and gate and up, each stacked as one product where they can be
    (:class:`Int8Stack`); its family's residual multiplier, whether it rotates its queries and keys, its MLP's
    activation (:data:`~batchspec.exact.integer.arithmetic.ACTIVATIONS`' code), whether it is a sliding layer
    (:attr:`~batchspec.families.Plan.sliding`), its scores' soft-cap (0: none) and, in place of gate, up and down,
    its mixture of experts where it has one."""

    norms: dict[str, ExactRMSNorm | None]  # by Norms' places: before, after, attention_out, mlp_out
    qkv: list[IntLinear] | Stack
    o: IntLinear
    q_norm: ExactRMSNorm | None
    k_norm: ExactRMSNorm | None
    gate_up: list[IntLinear] | Stack
    down: IntLinear | None
    scaling: float
    residual: float
    rotary: bool
    activation: int
    sliding: bool
    softcap: float
    mixture: plan.Mixture | None  # a mixture of experts' layer: its MLP (gate_up empty, down None)


@dataclass(frozen=True)
class _Rows:
    """Which of a forward's ``B * S`` positions are read: those that see a key (padding sees none).

    Example: ``B = 2``, ``S = 3``, row 0 left-padded by two: ``index = [2, 3, 4, 5]``; :meth:`take` keeps those
    rows of a ``[6, C]`` tensor, :meth:`spread` puts 4 rows back as ``[2, 3, C]`` with zeros at positions 0 and 1."""

    batch: int
    seq: int
    index: torch.Tensor | None  # [N] flat positions b * S + s; None: every position

    @classmethod
    def of(cls, visible: torch.Tensor) -> _Rows:
        batch, _, seq, _ = visible.shape  # [B, 1, S, L]
        seen = visible.any(-1).view(batch * seq)  # [B * S]
        return cls(batch, seq, None if bool(seen.all()) else seen.nonzero().squeeze(1))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``[B * S, C]`` -> ``[N, C]``."""
        return x if self.index is None else x.index_select(0, self.index)

    def kept(self, keep: int) -> _Kept:
        """The read positions among each row's last ``keep``: their places in :meth:`take`'s ``[N, C]`` and in a
        flat ``[B * keep]``. Example (the class's): ``keep = 2`` → taken ``[0, 2, 3]``, flat ``[1, 2, 3]``;
        ``keep = 1`` → taken ``[0, 3]``, flat ``[0, 1]``."""
        index = self.index  # [N]
        column = index % self.seq - (self.seq - keep)  # [N]: the position's place among its row's last keep
        taken = (column >= 0).nonzero().squeeze(1)  # [n]
        return _Kept(taken, (index // self.seq)[taken] * keep + column[taken])

    def scored(self, counts: torch.Tensor, keep: int) -> _Kept:
        """The read positions among each row's first ``counts[b]`` (``[B]``, at most ``keep``): their places in
        :meth:`take`'s ``[N, C]`` and in a flat ``[B * keep]``. Example (the class's), ``counts = [0, 2]``,
        ``keep = 2``: taken ``[1, 2]``, flat ``[2, 3]``."""
        index = torch.arange(self.batch * self.seq, device=counts.device) if self.index is None else self.index  # [N]
        row, column = index // self.seq, index % self.seq  # [N], [N]
        taken = (column < counts[row]).nonzero().squeeze(1)  # [n]
        return _Kept(taken, row[taken] * keep + column[taken])

    def spread(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` -> ``[B, S, C]``, zeros at the positions left out."""
        if self.index is None:
            return rows.view(self.batch, self.seq, rows.shape[-1])
        out = rows.new_zeros(self.batch * self.seq, rows.shape[-1]).index_copy_(0, self.index, rows)
        return out.view(self.batch, self.seq, rows.shape[-1])


@dataclass(frozen=True)
class _Kept:
    """:meth:`_Rows.kept`: ``taken`` ``[n]`` indexes the ``[N, C]`` rows read, ``flat`` ``[n]`` a ``[B * keep]``."""

    taken: torch.Tensor  # [n]
    flat: torch.Tensor  # [n]


def integer_forward(model: torch.nn.Module) -> IntegerForward | None:
    """:meth:`IntegerForward.of` ``model``, made once per model; where an integer model cannot have it (it then runs
    through transformers' forward, the same bits but slower), one log line says why.

    Made under a lock: making it moves the model's q, k, v (and gate, up) weights into stacked buffers, so a second
    thread (two servers over one model) must neither make it again nor run the model meanwhile; it waits, then gets
    the one made."""
    with _BUILDING:
        if model not in _FORWARDS:
            _FORWARDS[model] = IntegerForward.of(model)
            reason = _unsupported(model) if _FORWARDS[model] is None else None
            if reason is not None and isinstance(getattr(model, "lm_head", None), Int8Linear):
                logger.info("batchspec: %s runs its integer layers through transformers' forward, not batchspec's "
                            "fused one (%s)", type(model).__name__, reason)
        return _FORWARDS[model]


def forward_in_use(model: torch.nn.Module) -> str:
    """Which forward runs ``model``, for the load line and ``/v1/models``: ``fused`` (:class:`IntegerForward`), else
    ``transformers'``, with the reason an integer model is not fused."""
    if integer_forward(model) is not None:
        return "fused"
    if not isinstance(getattr(model, "lm_head", None), Int8Linear):
        return "transformers'"
    return f"transformers' ({_unsupported(model)})"


def _unsupported(model: Any) -> str | None:
    """Why :class:`IntegerForward` cannot run ``model``, or None where it can."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, name) for name in parts):
        return "its decoder is not laid out as Llama-like decoders are"
    if not native.available():
        return f"no native kernels: {native.isa()}"
    if not isinstance(decoder.rotary_emb, RotaryTable) or not isinstance(decoder.norm, ExactRMSNorm):
        return "its rotary embedding or final norm is not the exact one"
    embedding = decoder.embed_tokens  # its rows' dtype: ExactEmbedding's and GgufEmbedding's, else its table's
    embedded = embedding.dtype if hasattr(embedding, "dtype") else embedding.weight.dtype
    if not isinstance(getattr(model, "lm_head", None), Int8Linear) or embedded != torch.float32:
        return f"it computes in {str(embedded).removeprefix('torch.')}, not float32, or its output layer is not int8"
    norms = plan_of(model.config).norms
    if not decoder.layers or not all(_laid_out(module, norms) for module in decoder.layers):
        return "a decoder layer has parts other than a Llama-like layer's, or a product off the native kernels"
    size = decoder.layers[0].self_attn.head_dim
    if size > native.MAX_HEAD_SIZE:
        return f"its heads of {size} values are larger than the native attention's {native.MAX_HEAD_SIZE}"
    turned = {table.shape[-1] for table in decoder.rotary_emb.cos_tables()}  # a head's values that turn (partial)
    if len(turned) != 1:
        return f"its layer kinds' rotary embeddings turn different parts of a head ({sorted(turned)} values)"
    rotated = turned.pop()
    if rotated > size or rotated % 2:
        return f"its rotary embedding turns {rotated} values of heads of {size}, not an even number at most that"
    widths = {(m.self_attn.q_proj.out_features, m.self_attn.k_proj.out_features) for m in decoder.layers}
    if len(widths) != 1 or any(width % size for width in next(iter(widths))):
        return "its layers' attention widths differ or are not whole heads"
    return None


class IntegerForward:
    """The int8 model's forward over a :class:`~batchspec.engine.kv_cache.BatchKVCache` (see the module docstring).

    Attributes:
        heads, kv_heads, size: query heads, key/value heads and the head size of every layer.
    """

    def __init__(self, model: Any, layers: list[_Layer], heads: int, kv_heads: int, size: int, recipe: Plan) -> None:
        decoder = model.get_decoder()
        self.recipe = recipe  # the family's plan: the embedding's multiplier and the logits' divisor
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.head: Int8Linear = model.lm_head
        self.layers, self.heads, self.kv_heads, self.size = layers, heads, kv_heads, size  # layers: the plans' owners
        plan.check_layout(native.layout())
        made = [plan.layer(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}) for layer in layers]
        self.plans = (plan.Layer * len(made))(*made)  # the layers' layer_t structs, laid out once
        self.widths = plan.Widths.of(made, decoder.norm.weight.shape[0], heads, kv_heads, size)
        self.touched = _touched([m.mlp for m in decoder.layers], self.widths.experts)

    @classmethod
    def of(cls, model: Any) -> IntegerForward | None:
        """The forward of a model :func:`~batchspec.exact.integer.model.quantize_model` made, where the native kernels
        run and the model is float32 and laid out as Llama-like decoders are (:func:`_unsupported`); else None."""
        if _unsupported(model) is not None:
            return None
        decoder = model.get_decoder()
        attention = decoder.layers[0].self_attn
        size, queries, keys = attention.head_dim, attention.q_proj.out_features, attention.k_proj.out_features
        recipe = plan_of(model.config)
        rotary = recipe.rotary or (True,) * len(decoder.layers)
        sliding = recipe.sliding or (False,) * len(decoder.layers)
        layers = []
        for module, rotates, slides in zip(decoder.layers, rotary, sliding, strict=True):  # a stack copies q, k, v's
            layers.append(_layer(module, recipe, rotates, slides))  # (and gate, up's) weights into one buffer:
            give_back_freed_memory()  # the separate weights freed go back at once (0.6 GB kept, for the 1.5B pair)
        return cls(model, layers, queries // size, keys // size, size, recipe)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, cache: Any,
               keep: int, vocabulary: int = 0, scored: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[B, S]`` at ``positions`` ``[B, S]`` appended to ``cache``, queries seeing the keys
        ``visible`` ``[B, 1, S, L]`` marks; the logits of the last ``keep`` inputs, ``[B, keep, V]``. With
        ``vocabulary`` (0: all), only the first ``vocabulary`` tokens' logits are computed (see :meth:`output`).
        With ``scored`` ``[B]`` (at most ``keep`` each), the logits of each row's first ``keep`` inputs instead, of
        which only its first ``scored[b]`` are computed (zeros elsewhere): rows that feed more columns than are
        scored (a prompt read inside a verification) run the output layer on none of them."""
        rows = _Rows.of(visible)
        decoded = self._decode(input_ids, positions, visible, cache, rows)  # [N, H]
        if rows.index is None and scored is None:
            last = decoded.view(rows.batch, rows.seq, -1)[:, -keep:]  # [B, keep, H]
            return self.output(self.norm(last), vocabulary)  # [B, keep, V]
        # [n]: which of the N read positions are kept, as flat [B * keep]
        kept = rows.kept(keep) if scored is None else rows.scored(scored, keep)
        if not kept.taken.numel():  # no position scored (every row read a prompt)
            return decoded.new_zeros(rows.batch, keep, self.head.out_features)  # [B, keep, V]
        out = self.output(self.norm(decoded.index_select(0, kept.taken)), vocabulary)  # [n, V]
        logits = out.new_zeros(rows.batch * keep, out.shape[-1]).index_copy_(0, kept.flat, out)  # [B * keep, V]
        return logits.view(rows.batch, keep, -1)  # [B, keep, V]: zeros at the positions left out

    def output(self, x: torch.Tensor, vocabulary: int) -> torch.Tensor:  # [..., H] -> [..., V]
        """The output layer on ``x``; with ``vocabulary`` (a draft's, see ``SpecConfig.draft_vocabulary``; 0: all)
        over the first ``vocabulary`` token ids only, the others' logits :data:`UNREACHED`: a draft then reads that
        part of its output layer's weight, and proposes none of the other tokens."""
        if not vocabulary or vocabulary >= self.head.out_features:
            return self._scaled(self.head(x))
        part = self._scaled(self.head(x, vocabulary))  # [..., vocabulary]
        out = part.new_full((*part.shape[:-1], self.head.out_features), UNREACHED)  # [..., V]
        out[..., :vocabulary] = part
        return out

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits over the family's divisor (Granite's ``logits_scaling``), as its own forward divides them."""
        divisor = self.recipe.logits_divisor
        return logits if divisor == 1.0 else logits / divisor

    def read(self, input_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, cache: Any) -> None:
        """:meth:`logits` for the KV only: the final norm and the output layer do not run."""
        self._decode(input_ids, positions, visible, cache, _Rows.of(visible))

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, cache: Any,
                rows: _Rows) -> torch.Tensor:
        """The last layer's output at the positions ``rows`` reads, ``[N, H]``: every layer in one native call
        (``csrc/decoder.h``), on buffers made once for the forward."""
        batch, seq = input_ids.shape
        start, end = cache.length, cache.length + seq
        shape = (batch, self.kv_heads, 0, packed_width(self.size))
        store = cache.ensure_capacity(torch.empty(shape, dtype=torch.int16), end)  # [layers, 2, B, Hk, C, W]
        embedded = self.embed(input_ids)  # [B, S, H]
        if self.recipe.embedding_multiplier != 1.0:
            embedded = embedded * self.recipe.embedding_multiplier
        x = rows.take(embedded.view(batch * seq, -1))  # [N, H], the layers' input and output
        x = (x.clone() if rows.index is None else x).contiguous()
        made = plan.buffers(self.widths, x.shape[0], batch, seq, QUERY_CHUNK, rows.index is not None)
        sliding, typed = self.recipe.sliding or (), bool(self.rotary.layer_types)  # typed: a table per layer kind
        full, windowed = ((FULL,), (SLIDING,)) if typed else ((), ())  # untyped: every layer's the model's only one
        if not all(sliding) or not sliding:  # a layer reads the full layers' table
            made["cos"], made["sin"] = self.rotary(embedded, positions, *full)  # [B, S, D] each
        if any(sliding):  # the sliding layers' table and mask
            made["cos_sliding"], made["sin_sliding"] = self.rotary(embedded, positions, *windowed)  # [B, S, D] each
            visible = visible.contiguous()  # the windowed mask is laid out as it: the same strides serve both
            made["windowed"] = sliding_visible(visible, self.recipe.window)  # [B, 1, S, end]
        made = {name: tensor.contiguous() for name, tensor in made.items()}
        call = self._call(x, rows, visible, store, start, end, made)
        if self.touched is not None:  # the decoder marks the experts each mixture runs, as transformers' forward does
            call.touched, call.most_experts = self.touched.zero_().data_ptr(), self.widths.experts
        native.decoder(call, self.plans)
        cache.length = end
        return x

    def _call(self, x: torch.Tensor, rows: _Rows, visible: torch.Tensor, store: torch.Tensor, start: int, end: int,
              made: dict[str, torch.Tensor]) -> plan.Decoder:
        """The ``decoder_t`` of one forward: its shapes, inputs, the cache ``store`` and the buffers ``made`` (with
        the rotary tables ``cos``, ``sin``, the sliding layers' where there are any and their mask ``windowed``, laid
        out as ``visible``; these and the index must live until the call returns)."""
        if store.stride()[-2:] != (store.shape[-1], 1):
            raise ValueError(f"the KV cache {tuple(store.shape)} holds its tokens apart")
        if visible.dtype != torch.bool or visible.shape != (rows.batch, 1, rows.seq, end):
            raise ValueError(f"the mask must be bool [{rows.batch}, 1, {rows.seq}, {end}], not {visible.dtype} "
                             f"{list(visible.shape)}")
        call = plan.Decoder(n=x.shape[0], batch=rows.batch, seq=rows.seq, hidden=x.shape[1], heads=self.heads,
                            kv_heads=self.kv_heads, size=self.size, width=store.shape[-1], start=start, end=end,
                            chunk=QUERY_CHUNK, threads=torch.get_num_threads(),
                            rotated=made["cos" if "cos" in made else "cos_sliding"].shape[-1],
                            pairs=int(self.recipe.rotary_pairs), visible=visible.data_ptr(), store=store.data_ptr(),
                            levels=QKV_LEVELS, coefficients=ctypes.addressof(native.float_table(EXP2_COEFFICIENTS)))
        if rows.index is not None:
            made["index"] = rows.index.to(torch.int64).contiguous()  # [N]
        call.vb, _, call.vq, call.vl = visible.stride()
        call.s_layer, call.s_kv, call.s_batch, call.s_head, call.s_token = store.stride()[:5]
        call.x = x.data_ptr()
        for name, buffer in made.items():
            setattr(call, name, buffer.data_ptr())
        return call


def _laid_out(module: torch.nn.Module, norms: Norms) -> bool:
    """Whether a decoder layer is laid out as its family's plan says (an attention, an MLP and the ``norms``), on the
    integer modules, with no other part (but dropouts that pass their input through: Phi-3's, in eval mode)."""
    attention = getattr(module, "self_attn", None)
    named = [name for name in dataclasses.astuple(norms) if name is not None]
    parts = {"self_attn", "mlp"} | set(named)
    children = {name for name, child in module.named_children() if not _passes_through(child)}
    if children != parts or attention is None:
        return False
    names = {name for name, _ in attention.named_children()}
    if not names <= _ATTENTION_PARTS or not {"q_proj", "k_proj", "v_proj", "o_proj"} <= names:
        return False
    if len(names & {"q_norm", "k_norm"}) == 1:  # Qwen3 normalizes both; one alone is a layout this forward lacks
        return False
    linears = [getattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    layer_norms = [getattr(module, name) for name in named]
    layer_norms += [getattr(attention, name) for name in ("q_norm", "k_norm") if name in names]
    linears += _mlp_linears(module.mlp, norms)
    return (None not in linears and all(_native(linear) for linear in linears) and hasattr(attention, "scaling")
            and all(isinstance(norm, ExactRMSNorm) for norm in layer_norms))


def _mlp_linears(mlp: torch.nn.Module, norms: Norms) -> list[IntLinear | None]:
    """The integer layers of a decoder layer's MLP: a ``QuantizedMLP``'s three, or a mixture of experts' router and
    its experts' (where its input is normed before it and its output is not: the layout ``decoder.h``'s ``mixture``
    runs, with at most ``plan.MAX_EXPERTS`` experts); ``[None]`` where the MLP is neither."""
    if isinstance(mlp, QuantizedMLP):
        return [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    mixed = isinstance(mlp, SparseMoE) and len(mlp.experts) <= plan.MAX_EXPERTS
    if not mixed or norms.after is None or norms.mlp_out is not None:
        return [None]
    experts = [_mlp_linears(expert, norms) if isinstance(expert, QuantizedMLP) else [None] for expert in mlp.experts]
    return [mlp.gate, *(linear for linears in experts for linear in linears)]


def _touched(mlps: list[torch.nn.Module], experts: int) -> torch.Tensor | None:
    """The flags ``[layers, experts]`` (bool) the decoder sets where a layer's expert ran, laid out once, each
    mixture's :attr:`~batchspec.exact.integer.moe.SparseMoE.touched` made a view of its layer's row (so a forward
    marks them in place, with no copy per layer); None where no layer is a mixture."""
    if not any(isinstance(mlp, SparseMoE) for mlp in mlps):
        return None
    touched = torch.zeros(len(mlps), experts, dtype=torch.bool)  # [layers, E]: the decoder writes 0 or 1 bytes
    for row, mlp in zip(touched, mlps, strict=True):
        if isinstance(mlp, SparseMoE):
            mlp.touched = row[: len(mlp.experts)]
    return touched


def _passes_through(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a dropout that gives its input as it is (in eval mode, or of probability 0)."""
    return isinstance(module, torch.nn.Dropout) and (not module.training or module.p == 0)


def _native(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` is an integer layer whose product runs on the native kernels."""
    if isinstance(linear, Int8Linear):
        return linear.weight.kernel == "native"
    return isinstance(linear, Int4Linear) and linear.packed is not None


def _layer(module: torch.nn.Module, recipe: Plan, rotary: bool, sliding: bool) -> _Layer:
    """The parts of a decoder layer :func:`_laid_out` accepts, its q, k, v and gate, up stacked where they can be;
    its norms where its family's plan puts them, the plan's residual multiplier, whether it rotates its queries and
    keys, its MLP's activation, whether it is a sliding layer, and the soft-cap of its scores where the attention
    module holds one (Gemma 2's ``attn_logit_softcapping``, which it passes transformers' attention as
    ``softcap``)."""
    attention, mlp = module.self_attn, module.mlp
    qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
    norms = {place: None if name is None else getattr(module, name)
             for place, name in dataclasses.asdict(recipe.norms).items()}
    if isinstance(mlp, SparseMoE):
        experts = [(_stacked([e.gate_proj, e.up_proj]), e.down_proj) for e in mlp.experts]
        mixture = plan.Mixture(mlp.gate, experts, mlp.top_k, mlp.normalize)
        gate_up, down, activation = [], None, mlp.experts[0].activation
    else:
        mixture, gate_up, down, activation = None, _stacked([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, mlp.activation
    return _Layer(norms, _stacked(qkv), attention.o_proj, getattr(attention, "q_norm", None),
                  getattr(attention, "k_norm", None), gate_up, down, float(attention.scaling),
                  recipe.residual_multiplier, rotary, ACTIVATIONS[activation], sliding,
                  float(getattr(attention, "attn_logit_softcapping", None) or 0.0), mixture)


def _stacked(layers: list[IntLinear]) -> list[IntLinear] | Stack:
    """``layers`` as one stacked product where they can be (all int8 or all int4, see the stacks), else as they
    are."""
    return Int8Stack.of(layers) or Int4Stack.of(layers) or layers
