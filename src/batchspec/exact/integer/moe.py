"""A mixture-of-experts MLP (Qwen3-MoE's, OLMoE's, Mixtral's) whose every row's bits depend on that row alone.

transformers 5 holds a sparse block's experts as two 3-D parameters (``experts.gate_up_proj`` ``[E, 2I, H]``,
``experts.down_proj`` ``[E, H, I]``) and its router as ``gate.weight`` ``[E, H]``: softmax over the router's logits,
the ``top_k`` largest probabilities (``torch.topk``), renormalized to sum 1 where ``norm_topk_prob`` (Mixtral's
always: the softmax over the chosen k), each expert's ``down(act(gate(x)) * up(x))`` weighted and summed by
``index_add_`` expert after expert. :func:`split_experts` lays the block out as a :class:`SparseMoE` of Llama-like
layers instead (views of those weights, no copy), which quantization then swaps layer by layer, an expert at a time,
as it swaps a dense MLP's; its forward:

* the router is an integer product like every other layer's, so its logits are each row's own;
* the softmax is exact (:func:`route`): ``2**((l - max) * log2 e)`` by :func:`exp2_nonpositive`, summed by
  :func:`row_sum` (an order fixed by the number of experts);
* the top ``k`` are taken by a stable sort, so of equal probabilities the lowest expert index ranks first; the
  renormalization divides by their :func:`row_sum`;
* each expert runs on the rows routed to it (grouped by expert: an integer product's row is the same bits in any
  batch), and a row's outputs are summed by rank, ``((w0 e0 + w1 e1) + w2 e2) ...``, whatever other rows the batch
  holds.

A forward reads the weights of the experts its rows chose, the union over its rows and positions (a verification of
``k + 1`` tokens reads more experts than a one-token step): :func:`forward_bytes` counts them from the experts each
block last ran (:attr:`SparseMoE.touched`).
"""

from __future__ import annotations

from typing import Any

import torch

from batchspec.exact.integer.arithmetic import LOG2E, exp2_nonpositive, row_sum
from batchspec.exact.integer.linear import Int4Linear, Int8Linear


class Expert(torch.nn.Module):
    """One expert as a Llama's MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, ``activation`` the name of
    ``act_fn`` (transformers')."""

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear, act_fn: Any,
                 activation: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate, up, down, act_fn
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(torch.nn.Module):
    """A sparse block as :func:`split_experts` lays it out: the router ``gate`` (a linear layer, ``[H] -> [E]``), the
    experts (:class:`Expert`, or the integer model's ``QuantizedMLP`` once swapped), ``top_k`` and ``normalize``
    (``norm_topk_prob``). ``touched`` ``[E]`` (bool): the experts its last forward ran."""

    def __init__(self, gate: torch.nn.Linear, experts: list[torch.nn.Module], top_k: int, normalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= len(experts):
            raise ValueError(f"a sparse block of {len(experts)} experts cannot route to {top_k} of them")
        self.gate, self.experts, self.top_k, self.normalize = gate, torch.nn.ModuleList(experts), top_k, normalize
        self.register_buffer("touched", torch.zeros(len(experts), dtype=torch.bool), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, H]
        rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        weights, chosen = route(self.gate(rows), self.top_k, self.normalize)  # [N, k] each
        self.touched.zero_().index_fill_(0, chosen.flatten(), True)  # in place: it may view the fused forward's flags
        ranked = rows.new_zeros(rows.shape[0], self.top_k, rows.shape[1])  # [N, k, H]: expert outputs by rank
        for expert in self.touched.nonzero().flatten().tolist():
            token, rank = (chosen == expert).nonzero(as_tuple=True)  # [n] each
            ranked[token, rank] = self.experts[expert](rows.index_select(0, token))
        return combine(ranked, weights).view_as(hidden)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each row of router ``logits`` ``[N, E]`` and their weights: softmax probabilities
    (exact: :mod:`~batchspec.exact.integer.arithmetic`'s exp and fixed-order sum), ranked by a stable sort (ties: the
    lower index first), divided by their sum where ``normalize``. Returns ``(weights, experts)``, ``[N, k]`` each.

    Example: logits ``[0, 0, ln 2]`` with ``top_k = 2``: probabilities ``[1/4, 1/4, 1/2]``, experts ``[2, 0]``,
    weights ``[1/2, 1/4]`` (normalized: ``[2/3, 1/3]``)."""
    shifted = (logits - logits.amax(-1, keepdim=True)).mul_(LOG2E)  # [N, E], at most 0
    powers = exp2_nonpositive(shifted.contiguous())  # [N, E]
    probabilities = powers / row_sum(powers)  # [N, E]
    ranked, experts = torch.sort(probabilities, dim=-1, descending=True, stable=True)  # [N, E] each
    weights, experts = ranked[:, :top_k], experts[:, :top_k]  # [N, k] each
    if normalize:
        weights = weights / row_sum(weights)
    return weights, experts


def combine(ranked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``ranked`` ``[N, k, H]`` (each row's expert outputs by rank) weighted by ``weights`` ``[N, k]`` and summed in
    rank order: ``[N, H]``."""
    out = ranked[:, 0] * weights[:, :1]  # [N, H]
    for rank in range(1, ranked.shape[1]):
        out = out + ranked[:, rank] * weights[:, rank : rank + 1]
    return out


def is_sparse(block: torch.nn.Module) -> bool:
    """Whether ``block`` is transformers' sparse block: 3-D expert weights and a top-k router."""
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    weight = getattr(experts, "gate_up_proj", None)
    return isinstance(weight, torch.nn.Parameter) and weight.dim() == 3 and hasattr(gate, "top_k")


def split_experts(model: Any, activation: str) -> None:
    """Every sparse block of ``model`` (:func:`is_sparse`) as a :class:`SparseMoE` of views of its weights, in
    place; ``activation``: the experts' (transformers' name)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if is_sparse(child):
                setattr(module, name, _sparse(child, activation))


def _sparse(block: torch.nn.Module, activation: str) -> SparseMoE:
    """``block``'s router and experts as linear layers over its own weights' rows (views)."""
    experts, router = block.experts, block.gate
    fused, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
    inner = fused.shape[1] // 2
    made = [Expert(_linear(fused[e, :inner]), _linear(fused[e, inner:]), _linear(down[e]), experts.act_fn,
                   activation)
            for e in range(fused.shape[0])]
    return SparseMoE(_linear(router.weight.detach()), made, int(router.top_k),
                     bool(getattr(router, "norm_topk_prob", True)))


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A linear layer without a bias whose weight is ``weight`` ``[O, K]`` itself."""
    made = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    made.weight = torch.nn.Parameter(weight, requires_grad=False)
    return made


def forward_bytes(model: Any) -> int:
    """The bytes of integer weights ``model``'s last forward read (:func:`product_bytes`): every integer layer's but
    those of the experts no row of it chose (each :class:`SparseMoE` runs the union of its rows' experts,
    :attr:`SparseMoE.touched`)."""
    idle = {id(layer) for block in model.modules() if isinstance(block, SparseMoE)
            for expert, ran in zip(block.experts, block.touched.tolist(), strict=True) if not ran
            for layer in expert.modules()}
    return sum(product_bytes(m) for m in model.modules() if id(m) not in idle)


def product_bytes(layer: torch.nn.Module) -> int:
    """Bytes a product of integer layer ``layer`` reads of its weight (0 for any other module)."""
    if isinstance(layer, Int8Linear):
        return layer.weight.nbytes()
    if isinstance(layer, Int4Linear):
        return layer.packed.numel() if layer.weight4 is None else layer.weight4.nbytes()
    return 0
