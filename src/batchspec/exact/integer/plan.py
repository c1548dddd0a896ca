"""A decoder's layers as the native decoder reads them (``csrc/decoder.h``): each layer's constant parts laid out
once as a C struct (:func:`layer_plan`), and one forward's shapes and buffers (:class:`Decoder`), so the whole stack
of layers runs in one call (:func:`~batchspec.exact.integer.native.decoder`).

The structs hold raw addresses of the layers' tensors: a plan is valid while its layers (and their stacked weights)
live, which :class:`~batchspec.exact.integer.forward.IntegerForward` guarantees by holding both. They mirror
``decoder.h``'s typedefs (``_c_name_``): :func:`check_layout` compares every size and offset with the ones the C
compiler gave the build in use, so a field changed on one side only is refused before any forward runs."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch

from batchspec.exact.integer.linear import Int4Linear, Int4Stack, Int8Linear, Int8Stack, IntLinear

_i64, _pointer, _double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
MAX_SEGMENTS = 3  # outputs of one stacked product (q, k and v)


class Product(ctypes.Structure):
    """``product_t``: one int8 (``bits`` 8) or int4 (``bits`` 4) product and where its outputs go."""

    _c_name_ = "product_t"

    _fields_ = [("bits", _i64), ("inner", _i64), ("outputs", _i64), ("panels", _i64), ("segments", _i64),
                ("starts", _i64 * (MAX_SEGMENTS + 1)), ("weight", _pointer), ("comp", _pointer), ("scale", _pointer),
                ("bias", _pointer), ("groups", _i64), ("panel_bytes", _i64), ("subs", _i64), ("block", _i64)]


MAX_EXPERTS = 256  # decoder.h's: the experts a layer's mixture may have


class Expert(ctypes.Structure):
    """``expert_t``: one expert's gate and up (one or two products) and down."""

    _c_name_ = "expert_t"

    _fields_ = [("gate_up_count", _i64), ("gate_up", Product * 2), ("down", Product)]


class Layer(ctypes.Structure):
    """``layer_t``: one decoder layer's norms, products and attention scaling; a mixture of experts' router, top k
    and experts (``expert``: the address of an :class:`Expert` array, held by the layer's :class:`Mixture`)."""

    _c_name_ = "layer_t"

    _fields_ = [("before", _pointer), ("after", _pointer), ("attention_out", _pointer), ("mlp_out", _pointer),
                ("q_norm", _pointer), ("k_norm", _pointer), ("eps_before", _double), ("eps_after", _double),
                ("eps_attention_out", _double), ("eps_mlp_out", _double), ("eps_q", _double), ("eps_k", _double),
                ("factor", _double), ("residual", _double), ("softcap", _double), ("rotary", _i64), ("whole", _i64),
                ("qkv_count", _i64), ("gate_up_count", _i64), ("activation", _i64), ("sliding", _i64),
                ("qkv", Product * 3), ("o", Product), ("gate_up", Product * 2), ("down", Product),
                ("experts", _i64), ("top_k", _i64), ("normalize", _i64), ("router", Product), ("expert", _pointer)]


_BUFFERS = ("x", "h", "normed", "q", "k", "v", "qs", "ks", "vs", "query", "block_query", "attended", "block_out",
            "gathered", "gate", "up", "codes8", "scale8", "codes4", "xs", "sums4", "routed", "grouped", "expert_out",
            "ranked", "logits", "weights", "chosen", "members")


class Decoder(ctypes.Structure):
    """``decoder_t``: one forward's shapes, inputs and buffers (field by field as ``csrc/decoder.h`` states)."""

    _c_name_ = "decoder_t"

    _fields_ = [(name, _i64) for name in ("n", "batch", "seq", "hidden", "heads", "kv_heads", "size", "width",
                                          "start", "end", "chunk", "threads")]
    _fields_ += [("index", _pointer), ("cos", _pointer), ("sin", _pointer), ("cos_sliding", _pointer),
                 ("sin_sliding", _pointer), ("rotated", _i64), ("pairs", _i64), ("visible", _pointer),
                 ("windowed", _pointer), ("vb", _i64),
                 ("vq", _i64), ("vl", _i64), ("store", _pointer), ("s_layer", _i64), ("s_kv", _i64),
                 ("s_batch", _i64), ("s_head", _i64), ("s_token", _i64), ("levels", _double),
                 ("coefficients", _pointer)]
    _fields_ += [(name, _pointer) for name in _BUFFERS]
    _fields_ += [("touched", _pointer), ("most_experts", _i64)]


MIRRORS = (Product, Expert, Layer, Decoder)


def check_layout(native: dict[tuple[str, str], int], mirrors: tuple[type[ctypes.Structure], ...] = MIRRORS) -> None:
    """Raise where a mirror's size, fields or offsets differ from ``native`` (:func:`~batchspec.exact.integer.native.
    layout`: ``(typedef, field)`` to its offset, ``(typedef, "")`` to its size)."""
    for mirror in mirrors:
        name = mirror._c_name_
        ours = {field[0]: getattr(mirror, field[0]).offset for field in mirror._fields_}
        theirs = {field: value for (kind, field), value in native.items() if kind == name and field}
        problems = [f"{field} at {ours.get(field)} here, {theirs.get(field)} in C"
                    for field in sorted(ours.keys() | theirs.keys()) if ours.get(field) != theirs.get(field)]
        if ctypes.sizeof(mirror) != native.get((name, "")):
            problems.append(f"{ctypes.sizeof(mirror)} bytes here, {native.get((name, ''))} in C")
        if problems:
            raise RuntimeError(f"plan.{mirror.__name__} does not mirror decoder.h's {name}: {'; '.join(problems)}")


def product(layers: list[IntLinear] | Int8Stack | Int4Stack) -> Product:
    """The product of one layer (a list of one) or of a stack, its outputs one segment per stacked layer."""
    if isinstance(layers, list):
        (layer,) = layers
        widths = (layer.out_features,)
    else:
        layer, widths = layers, layers.widths
    if len(widths) > MAX_SEGMENTS:
        raise ValueError(f"a product gives at most {MAX_SEGMENTS} outputs, not {len(widths)}")
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)
    made = Product(segments=len(widths), outputs=starts[-1], bias=_address(layer.bias))
    made.starts[: len(starts)] = starts
    if isinstance(layer, Int8Linear | Int8Stack):
        panels, comp = layer.tensors if isinstance(layer, Int8Stack) else layer.weight.tensors
        made.bits, made.inner, made.panels, made.groups = 8, layer.in_features, panels.shape[0], panels.shape[1]
        made.weight, made.comp, made.scale = panels.data_ptr(), comp.data_ptr(), layer.scale.data_ptr()
    elif isinstance(layer, Int4Linear | Int4Stack):
        packed = layer.packed
        made.bits, made.inner, made.panels, made.panel_bytes = 4, layer.in_features, packed.shape[0], packed.shape[1]
        made.subs, made.block, made.weight = layer.subs, layer.block, packed.data_ptr()
    else:
        raise TypeError(f"no native product for {type(layer).__name__}")
    return made


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Mixture:
    """A mixture of experts' layers (:class:`~batchspec.exact.integer.moe.SparseMoE`'s, swapped): its ``router``,
    each expert's gate and up (stacked where they can be) and down, ``top_k`` and ``normalize``; ``table`` the
    experts' ``expert_t`` array, laid out once (the layers it points at live as long as this)."""

    router: IntLinear
    experts: list[tuple[list[IntLinear] | Int8Stack | Int4Stack, IntLinear]]
    top_k: int
    normalize: bool
    table: ctypes.Array = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < len(self.experts) <= MAX_EXPERTS:
            raise ValueError(f"a mixture of {len(self.experts)} experts; the fused forward takes 1 to {MAX_EXPERTS}")
        made = []
        for gate_up, down in self.experts:
            products = _products(gate_up)
            expert = Expert(gate_up_count=len(products), down=product([down]))
            expert.gate_up[: len(products)] = products
            made.append(expert)
        object.__setattr__(self, "table", (Expert * len(made))(*made))


def layer(norms: dict[str, torch.nn.Module | None], qkv: list[IntLinear] | Int8Stack | Int4Stack, o: IntLinear,
          q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None,
          gate_up: list[IntLinear] | Int8Stack | Int4Stack, down: IntLinear | None, scaling: float, residual: float,
          rotary: bool, activation: int, sliding: bool, softcap: float = 0.0, mixture: Mixture | None = None) -> Layer:
    """One decoder layer's ``layer_t``: its RMSNorms (``ExactRMSNorm``: ``weight``, ``eps``) by where they sit
    (``before``, ``after``, ``attention_out``, ``mlp_out``: see ``decoder.h``; a norm left out or None is not there),
    its products (q, k and v, and gate and up, each one stacked product or a product per layer), its query and key
    norms (over each head, or over the whole projection where their weight is that wide), the attention's
    ``scaling``, the multiplier of its outputs on their way into the residual stream, whether it rotates its
    queries and keys, its MLP's ``activation`` (:data:`~batchspec.exact.integer.arithmetic.ACTIVATIONS`' code) and
    whether it is ``sliding`` (attends over the windowed mask and rotates by the sliding layers' table), and the
    ``softcap`` of its attention's scores (0: none; ``layer_t`` holds it in units of log2, over ln 2). With a
    ``mixture`` the layer's MLP is that mixture of experts (``gate_up`` empty, ``down`` None)."""
    qkv_products, gate_up_products = _products(qkv), _products(gate_up)
    made = Layer(factor=scaling / math.log(2.0), residual=residual, softcap=softcap / math.log(2.0),
                 rotary=int(rotary), activation=activation, sliding=int(sliding), qkv_count=len(qkv_products),
                 gate_up_count=len(gate_up_products), o=product([o]),
                 down=Product() if down is None else product([down]))
    for name, norm in norms.items():
        if norm is not None:
            setattr(made, name, norm.weight.data_ptr())
            setattr(made, f"eps_{name}", norm.eps)
    if q_norm is not None and k_norm is not None:
        made.q_norm, made.k_norm = q_norm.weight.data_ptr(), k_norm.weight.data_ptr()
        made.eps_q, made.eps_k = q_norm.eps, k_norm.eps
        made.whole = int(q_norm.weight.numel() == _query_width(qkv))
    made.qkv[: len(qkv_products)] = qkv_products
    made.gate_up[: len(gate_up_products)] = gate_up_products
    if mixture is not None:
        made.experts, made.top_k, made.normalize = len(mixture.experts), mixture.top_k, int(mixture.normalize)
        made.router, made.expert = product([mixture.router]), ctypes.addressof(mixture.table)
    return made


def experts_of(made: Layer) -> ctypes.Array:
    """The ``expert_t`` structs of layer ``made``'s mixture (empty where it has none)."""
    return (Expert * made.experts).from_address(made.expert) if made.experts else (Expert * 0)()


def _query_width(qkv: list[IntLinear] | Int8Stack | Int4Stack) -> int:
    """The width of the queries, q's outputs."""
    return qkv[0].out_features if isinstance(qkv, list) else qkv.widths[0]


def _products(layers: list[IntLinear] | Int8Stack | Int4Stack) -> list[Product]:
    return [product([one]) for one in layers] if isinstance(layers, list) else [product(layers)]


@dataclass(frozen=True)
class Widths:
    """What sizes one forward's buffers need, read once from the model: the hidden size, the heads, the MLP's
    inner size (an expert's too), the widest activations each product form takes (int8 codes; int4 codes, scales and
    sums), whether a layer's products read its norm's output in more than one form (it is then written out once),
    and the most experts and experts a row chooses of any layer's mixture (0: none has one)."""

    hidden: int
    heads: int
    kv_heads: int
    size: int
    ffn: int
    codes8: int
    padded4: int
    blocks4: int
    counted4: int
    normed: bool
    experts: int
    top_k: int

    @classmethod
    def of(cls, layers: list[Layer], hidden: int, heads: int, kv_heads: int, size: int) -> Widths:
        experts = [expert for made in layers for expert in experts_of(made)]
        groups = [made.qkv[: made.qkv_count] for made in layers] + [made.gate_up[: made.gate_up_count]
                                                                      for made in layers]
        products = [p for made in layers for p in (*made.qkv[: made.qkv_count], made.o,
                                                    *made.gate_up[: made.gate_up_count], made.down, made.router)]
        products += [p for expert in experts for p in (*expert.gate_up[: expert.gate_up_count], expert.down)]
        int8 = [p for p in products if p.bits == 8] or [Product(groups=0)]
        int4 = [p for p in products if p.bits == 4] or [Product(inner=0, block=1)]
        downs = [made.down for made in layers] + [expert.down for expert in experts]
        return cls(hidden, heads, kv_heads, size, max(p.inner for p in downs), max(4 * p.groups for p in int8),
                   max(32 * -(-p.inner // 32) for p in int4), max(-(-p.inner // p.block) for p in int4),
                   max(-(-p.inner // 32) + -(-p.inner // 32) % 2 for p in int4),
                   any(len({_form(p) for p in group}) > 1 for group in groups),
                   max(made.experts for made in layers), max(made.top_k for made in layers))


def _form(p: Product) -> tuple[int, int]:
    """Which activations ``p`` reads of its input (decoder.h's ``same_form``)."""
    return (8, 0) if p.bits == 8 else (4, p.block)


def buffers(widths: Widths, n: int, batch: int, seq: int, chunk: int, spread: bool) -> dict[str, torch.Tensor]:
    """One forward's buffers for ``n`` of ``batch * seq`` positions (``spread``: some are left out, so the
    attention's inputs are laid out again and its outputs gathered), queries in blocks of ``chunk``."""
    wq, wk, rows = widths.heads * widths.size, widths.kv_heads * widths.size, batch * seq
    block = min(seq, chunk) if seq > chunk else 0
    made = {
        "h": torch.empty(n, widths.hidden), "normed": torch.empty(n, widths.hidden if widths.normed else 0),
        "q": torch.empty(n, wq), "k": torch.empty(n, wk), "v": torch.empty(n, wk),
        "query": torch.empty(batch, widths.heads, seq, widths.size),
        "block_query": torch.empty(batch, widths.heads, block, widths.size),
        "attended": torch.empty(batch, seq, widths.heads, widths.size),
        "block_out": torch.empty(batch, block, widths.heads, widths.size),
        "gate": torch.empty(n, widths.ffn), "up": torch.empty(n, widths.ffn),
        "codes8": torch.empty(n, widths.codes8, dtype=torch.uint8), "scale8": torch.empty(n),
        "codes4": torch.empty(n, widths.padded4, dtype=torch.int8), "xs": torch.empty(n, widths.blocks4),
        "sums4": torch.empty(n, widths.counted4, dtype=torch.int16),
    }
    mixed, top_k = n if widths.experts else 0, widths.top_k
    made.update(routed=torch.empty(mixed, widths.hidden), grouped=torch.empty(mixed, widths.hidden),
                expert_out=torch.empty(mixed, widths.hidden), ranked=torch.empty(mixed, top_k, widths.hidden),
                logits=torch.empty(mixed, widths.experts), weights=torch.empty(mixed, top_k),
                chosen=torch.empty(mixed, top_k, dtype=torch.int64), members=torch.empty(mixed, dtype=torch.int64))
    spread_rows = rows if spread else 0  # zeros at the padding, which no row written later changes
    made.update(qs=torch.zeros(spread_rows, wq), ks=torch.zeros(spread_rows, wk), vs=torch.zeros(spread_rows, wk),
                gathered=torch.empty(n if spread else 0, wq))
    return made
