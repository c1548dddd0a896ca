"""Decode forwards at fixed shapes, captured as CUDA graphs and replayed (``--cuda-graphs``).

A decode round's forwards are small (one verification of ``1 + k`` columns, ``k`` one-column draft steps), so on a GPU
their cost is the host launching kernels, not the kernels. A CUDA graph records a forward's kernels once and replays
them with one launch. It replays the same kernels on the same addresses, so everything that changes between rounds
must live in tensors the graph reads, never in Python numbers:

* the forward runs in the KV cache's static mode (:meth:`~batchspec.engine.kv_cache.BatchKVCache.writing_at`): it writes
  at columns held in a tensor and attends over the cache's whole capacity, not over its current length;
* the attention mask and the position ids are computed inside the graph from three static input buffers: the input
  ids ``[B, q]``, the columns written ``[q]`` and each row's padding ``[B]`` (invariants I1/I2 of
  :mod:`batchspec.engine.state`): a query at column ``c`` sees the keys at columns ``pad <= j <= c``, so whatever the
  capacity holds past the length is never seen;
* the logits come out in a static buffer, overwritten by the next replay of the same graph (every caller consumes
  them before the next forward).

A graph is captured per (model, KV storage, batch size, columns, logits kept), the second time that shape runs on
that storage (the first runs as an ordinary forward), and replayed from the third: rows in lockstep (the
autoregressive method, rounds whose rows all accept alike) keep their storage round after round, while a batch laid
out afresh (rows shifted, joined or finished; :mod:`batchspec.engine.realign` gathers them into new storage) or a
storage grown would otherwise pay a capture for one forward. The model's graphs of other storages are dropped. Forwards
of more than :data:`MAX_GRAPH_COLUMNS` columns (prompts, a draft catching up) and forwards whose storage must first
grow run ordinarily. All graphs share one memory pool: they replay one at a time.

With ``capture=False`` the same static-mode forward runs eagerly every time: what the CPU tests check (the static
mode's tokens equal the ordinary forward's), and what a GPU would replay.

Worked example (``pad = [0, 2]``, capacity 6, a 1-column step at column 4)::

    key column       0 1 2 3 4 5
    row 0, query 4   1 1 1 1 1 0     column 5 (past the length) is masked, whatever it holds
    row 1, query 4   0 0 1 1 1 0     and so is row 1's padding
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from batchspec.config import CudaGraphs
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.state import position_ids, visible_keys
from batchspec.families import attention_window

MAX_GRAPH_COLUMNS = 16  # the widest forward captured: a verification of 1 + k columns, k <= 15
GRAPHED_ATTENTION = ("sdpa", "eager")  # the attention implementations a static-mode forward runs with
GraphMode = Literal["off", "on", "eager"]  # no static mode; captured graphs (CUDA); static mode run eagerly (tests)


def graph_mode(setting: str, device: torch.device, models: tuple[torch.nn.Module, ...] = ()) -> GraphMode:
    """The runner's graphs for the ``cuda_graphs`` setting with ``models`` on ``device``: captured for ``"on"``,
    which needs a CUDA device and models whose attention is one of :data:`GRAPHED_ATTENTION`, and for ``"auto"`` on
    a CUDA device (measured on an H100: the same tokens as eager forwards, and a Qwen2.5-7B-shaped decode step in
    8.9 ms instead of 37.5; docs/gpu.md), where the forwards of other attention implementations (the
    batch-invariant mode's) run as they come."""
    choice, cuda = CudaGraphs(setting), torch.device(device).type == "cuda"
    if choice is CudaGraphs.OFF or (choice is CudaGraphs.AUTO and not cuda):
        return "off"
    if not cuda:
        raise ValueError(f"--cuda-graphs on needs the models on a CUDA device (--device cuda); they are on {device}")
    check_graphed(choice, models)
    return "on"


def check_graphed(setting: str, models: tuple[torch.nn.Module, ...]) -> None:
    """Raise ValueError where ``setting`` is ``"on"`` and one of ``models`` runs an attention a static-mode forward
    cannot (:data:`GRAPHED_ATTENTION`): what only the loaded models answer, once the device's part of
    :func:`graph_mode` is settled."""
    for model in models if CudaGraphs(setting) is CudaGraphs.ON else ():
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation not in GRAPHED_ATTENTION:
            raise ValueError(
                f"--cuda-graphs on captures models with {' or '.join(GRAPHED_ATTENTION)} attention; this one runs "
                f"{implementation!r} (the batch-invariant mode's forwards are not graphed yet): use --cuda-graphs auto "
                "or off"
            )


@dataclass
class _Graph:
    """One captured forward and its static buffers."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B, q]
    columns: torch.Tensor  # [q]
    pad: torch.Tensor  # [B]
    logits: torch.Tensor  # [B, keep, V]


class GraphedForwards:
    """Static-mode decode forwards, captured as CUDA graphs (``capture=True``) or run eagerly (``capture=False``).

    ``forward(model, cache, input_ids, columns, pad, keep)`` is the model call of the runner
    (:meth:`~batchspec.engine.runner.ModelRunner.logits`), given the mask and positions built here.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], *, capture: bool) -> None:
        self.forward = forward
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()  # shapes run once on their storage, captured if they run again
        self.captured = 0  # graphs captured so far (each capture costs about one eager forward)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream() if capture else None  # where graphs are recorded

    def handles(self, cache: BatchKVCache, end: int, columns: int) -> bool:
        """Whether a forward of ``columns`` ending at column ``end`` runs here: a decode-sized forward into storage
        that already holds column ``end - 1``."""
        return columns <= MAX_GRAPH_COLUMNS and cache.storage is not None and cache.storage.shape[4] >= end

    def logits(
        self, model: torch.nn.Module, cache: BatchKVCache, input_ids: torch.Tensor, pad: torch.Tensor, keep: int
    ) -> torch.Tensor | None:
        """Feed ``input_ids`` ``[B, q]`` as the columns after ``cache.length`` of rows padded by ``pad`` ``[B]``;
        returns the logits of the last ``keep`` inputs ``[B, keep, V]`` and advances ``cache.length``. Returns None
        (and runs nothing) where the forward should run ordinarily: the first time its shape runs on this storage."""
        storage = cache.storage
        key = (id(model), storage.data_ptr(), tuple(storage.shape), *input_ids.shape, keep)
        if self.capture and key not in self.graphs:
            self._drop_other_storages(key)
            if key not in self.seen:
                self.seen.add(key)
                return None
        start = cache.length
        end = start + input_ids.shape[1]
        inputs = (input_ids, torch.arange(start, end, device=input_ids.device), pad)  # [B, q], [q] columns, [B]
        graph = self.graphs.get(key)
        if graph is None:
            logits = self._static_forward(model, cache, inputs, keep)
            if self.capture:  # the forward above is this one's result; the graph serves the next ones
                self.graphs[key] = self._capture(model, cache, inputs, keep)
        else:
            for static, value in zip((graph.input_ids, graph.columns, graph.pad), inputs, strict=True):
                static.copy_(value)
            graph.graph.replay()
            logits = graph.logits
        cache.length = end
        return logits

    def _capture(
        self, model: torch.nn.Module, cache: BatchKVCache, inputs: tuple[torch.Tensor, ...], keep: int
    ) -> _Graph:
        """Record the forward on copies of its ``inputs``. It first runs once more on the capture stream, so that
        what a stream sets up lazily (cuBLAS's workspace) exists before recording; that run writes the same keys and
        values the caller's forward just wrote. Recording runs no kernel."""
        inputs = tuple(value.clone() for value in inputs)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._static_forward(model, cache, inputs, keep)
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            logits = self._static_forward(model, cache, inputs, keep)
        self.captured += 1
        return _Graph(graph, *inputs, logits)

    def _drop_other_storages(self, key: tuple) -> None:
        """Forget the model's graphs and shapes seen on other storages (a batch laid out afresh, or grown, no longer
        uses them)."""
        def current(known: tuple) -> bool:  # another model's, or this model's on this storage
            return known[0] != key[0] or known[1:3] == key[1:3]

        self.graphs = {known: graph for known, graph in self.graphs.items() if current(known)}
        self.seen = {known for known in self.seen if current(known)}

    def _static_forward(
        self, model: torch.nn.Module, cache: BatchKVCache, inputs: tuple[torch.Tensor, ...], keep: int
    ) -> torch.Tensor:
        """The forward in the cache's static mode; ``inputs``: input ids ``[B, q]``, their columns ``[q]``, each
        row's padding ``[B]``."""
        input_ids, columns, pad = inputs
        visible = visible_keys(columns, pad, cache.storage.shape[4], attention_window(model.config))  # [B, 1, q, cap]
        positions = position_ids(columns, pad)  # [B, q]
        with cache.writing_at(columns):
            return self.forward(model, cache, input_ids, visible, positions, keep)
