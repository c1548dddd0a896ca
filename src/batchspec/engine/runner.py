"""The model runner: everything between the engine's host-side decisions and the device.

It owns

* every forward of the target and the draft: feeding columns of a batch's padded layout into one of the batch's KV
  caches (:meth:`ModelRunner.logits`, and :meth:`ModelRunner.read` for the KV only), with the attention mask and
  position ids built on the device from the batch's pad lengths (invariants I1/I2 of :mod:`batchspec.engine.state`);
* the staging of host numbers a round needs on the device (:meth:`ModelRunner.stage`: one host buffer, pinned on
  CUDA, and one host→device copy per call, which does not wait for the device; the engine stages everything a
  round needs in one call, :meth:`~batchspec.engine.core.Engine.stage_round`);
* the round's one device→host read (:meth:`ModelRunner.fetch`), the only place the host waits for the device
  while rows decode;
* device-side timing (:meth:`ModelRunner.mark` / :meth:`ModelRunner.seconds`): CUDA events on a GPU, read after
  the round's read has synchronised, the wall clock on the CPU.

The host already knows everything that steers a round (each row's length, pad, proposal length, lookups and
sampling settings), so proposers and the verifier are tensor code that never reads the device back; only the
verdict (accepted counts and tokens) comes back, once.

Worked example of the attention mask of a forward (``pad = [0, 2]``, the cache holds 3 columns, 2 new ones)::

    key column       0 1 2 3 4
    row 0, query 3   1 1 1 1 0     causal: a query sees its own column and the ones before
    row 0, query 4   1 1 1 1 1
    row 1, query 3   0 0 1 1 0     row 1's padding (columns 0, 1) is never seen
    row 1, query 4   0 0 1 1 1
"""

from __future__ import annotations

import inspect
import math
import struct
import time
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchspec.engine.errors import InvariantError
from batchspec.engine.graphs import GRAPHED_ATTENTION, GraphedForwards, GraphMode
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.state import BatchState, visible_keys
from batchspec.exact.integer.attention import NAME as EXACT_ATTENTION
from batchspec.exact.integer.forward import integer_forward
from batchspec.exact.invariant.model import NAME as INVARIANT_ATTENTION
from batchspec.families import FULL, SLIDING, attention_window, plan_of, sliding_visible


@dataclass(frozen=True)
class Floats:
    """A column of floats for :meth:`ModelRunner.stage` (staged as float64)."""

    values: Seq[float]


class ModelRunner:
    """Runs forwards, staging and the round's read on one device (that of the models it is given).

    Attributes:
        device: where the models are.
        cuda: whether that is a GPU (pinned staging, CUDA-event timing).
        free_reads: whether reading the device back waits for nothing (the CPU). Code that can save work by reading
            a device value (the hybrid proposer's lookup hits, which let it skip a draft forward) reads it only
            there; on a GPU a decode round reads once, in :meth:`fetch`.
    """

    def __init__(self, device: torch.device, graphs: GraphMode = "off") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.free_reads = self.device.type == "cpu"  # reading a CPU tensor waits for nothing
        self.graphs = None if graphs == "off" else GraphedForwards(_static_call, capture=graphs == "on")

    def logits(
        self,
        model: torch.nn.Module,
        batch: BatchState,
        cache: BatchKVCache,
        input_ids: torch.Tensor,
        *,
        keep: int,
        fed: torch.Tensor | None = None,
        vocabulary: int = 0,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed ``input_ids`` ``[B, q]`` as the columns right after the ones ``cache`` holds; returns the logits of
        the last ``keep`` inputs, ``[B, keep, V]``. Columns at or past the batch width (drafts) count as real.
        Decode-sized forwards go through the CUDA graphs where they are on (:mod:`batchspec.engine.graphs`).

        ``fed`` ``[B]`` (a ragged verification): row ``i`` needs only its first ``fed[i]`` inputs. Where the model
        runs on the fused integer forward (:meth:`ragged`) the others are left out of every product, their logits
        are zeros and their KV columns hold zeros (the caller drops them); elsewhere every input is computed.

        ``vocabulary`` (a draft's; 0: all): on the fused integer forward, only the first ``vocabulary`` tokens'
        logits are computed and the others are far below them
        (:meth:`~batchspec.exact.integer.forward.IntegerForward.output`); elsewhere every logit is.

        ``scored`` ``[B]`` (the fused integer forward only, with ``fed``): the logits are those of each row's first
        ``keep`` inputs, of which row ``i`` needs its first ``scored[i]`` (:mod:`batchspec.engine.riding`: a row
        reading its prompt feeds more columns than the round scores, and needs no logits)."""
        forward = integer_forward(model) if cache.write_at is None else None
        if forward is not None:  # the int8 model's own forward: the same bits as the model's, in fewer calls
            positions, visible = _placement(model, batch, cache, input_ids)
            if fed is not None:
                queries = torch.arange(input_ids.shape[1], device=fed.device)  # [q]
                visible = visible & (queries[None, None, :, None] < fed[:, None, None, None])  # [B, 1, q, end]
            return forward.logits(input_ids, positions, visible, cache, keep, vocabulary, scored)
        if scored is not None:
            raise InvariantError("only the fused integer forward scores each row's first inputs")
        end = cache.length + input_ids.shape[1]
        graphed = self.graphs is not None and _implementation(model) in GRAPHED_ATTENTION
        with attention_backends(self.device):
            if graphed and self.graphs.handles(cache, end, input_ids.shape[1]):
                logits = self.graphs.logits(model, cache, input_ids, batch.pad, keep)
                if logits is not None:
                    return logits
            return model(**_inputs(model, batch, cache, input_ids), logits_to_keep=keep).logits

    @staticmethod
    def ragged(model: torch.nn.Module) -> bool:
        """Whether :meth:`logits` leaves out the inputs a row does not need (``fed``): its cost then follows the
        tokens fed, not the rows times the widest row's."""
        return integer_forward(model) is not None

    def read(self, model: torch.nn.Module, batch: BatchState, cache: BatchKVCache, input_ids: torch.Tensor) -> None:
        """Feed ``input_ids`` ``[B, q]`` like :meth:`logits`, for their KV only: the decoder runs, the output layer
        (``[B, q, V]`` logits, the largest matrix product of a prefill) does not."""
        forward = integer_forward(model) if cache.write_at is None else None
        if forward is not None:
            forward.read(input_ids, *_placement(model, batch, cache, input_ids), cache)
            return
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if decoder is None:
            self.logits(model, batch, cache, input_ids, keep=1)
            return
        with attention_backends(self.device):
            decoder(**_inputs(decoder, batch, cache, input_ids))

    def stage(self, *columns: Seq[int] | Seq[Seq[int]] | Floats) -> tuple[torch.Tensor, ...]:
        """Device tensors of host ``columns``, in one host buffer and one copy: int64 for a list ``[n]`` or a
        rectangular list of lists ``[n, m]``, float64 for :class:`Floats` ``[n]`` (carried as their bits). On CUDA
        the buffer is pinned and the copy does not block the host; torch's host allocator keeps the buffer until
        the copy is done.

        Example: ``stage([0, 2], [[5, 6], [7, 8]], Floats([0.5]))`` → ``tensor([0, 2])``,
        ``tensor([[5, 6], [7, 8]])``, ``tensor([0.5], dtype=torch.float64)``.
        """
        flat: list[int] = []
        shapes: list[tuple[tuple[int, ...], bool]] = []  # (shape, float64)
        for column in columns:
            if isinstance(column, Floats):
                flat.extend(_bits(value) for value in column.values)
                shapes.append(((len(column.values),), True))
            elif column and isinstance(column[0], Seq):
                width = len(column[0])
                if not all(len(row) == width for row in column):
                    raise InvariantError("a staged matrix must be rectangular")
                for row in column:
                    flat.extend(row)
                shapes.append(((len(column), width), False))
            else:
                flat.extend(column)
                shapes.append(((len(column),), False))
        host = torch.tensor(flat, dtype=torch.long)
        if self.cuda:
            host = host.pin_memory()
        device = host.to(self.device, non_blocking=True)
        parts = device.split([math.prod(shape) for shape, _ in shapes])
        return tuple(
            part.view(torch.float64) if floats else part.view(shape)
            for part, (shape, floats) in zip(parts, shapes, strict=True)
        )

    def fetch(self, *tensors: torch.Tensor) -> list[list[int]]:
        """The round's one device→host read: ``tensors`` (each ``[B]`` or ``[B, m]``, integer) side by side, as
        one list of ints per row. This is where the host waits for the device (a synchronisation on CUDA).

        Example: ``fetch(tensor([1, 0]), tensor([[7, 8], [9, 4]]))`` → ``[[1, 7, 8], [0, 9, 4]]``.
        """
        parts = [t.reshape(t.shape[0], -1).long() for t in tensors]
        return torch.cat(parts, dim=1).tolist()  # the sync

    def wait(self) -> None:
        """Wait for the device to finish what it was given (a synchronisation on CUDA, nothing elsewhere): used
        after reading a prompt, so that its host-clock time is the device's."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> float | torch.cuda.Event:
        """A point in the device's time: a recorded CUDA event on a GPU (no wait), the wall clock elsewhere."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        """Seconds between two :meth:`mark` points; on CUDA, call it after :meth:`fetch` (the events are done by
        then, so reading them does not wait)."""
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1000


_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> AbstractContextManager:
    """The scaled-dot-product attention kernels the runner's forwards may use: on CUDA every one but cuDNN's.

    cuDNN's attention builds an execution plan for each new shape, and a decode forward's key length grows by one
    every round: measured on an H100 (a Qwen2.5-7B-shaped model in bfloat16, 8 rows, 32 new tokens, eager forwards),
    34.6 tokens/s with cuDNN's kernel allowed against 163.5 without it (``docs/results/2026-11-25-gpu``).
    """
    return sdpa_kernel(_NOT_CUDNN) if device.type == "cuda" else nullcontext()


def _bits(value: float) -> int:
    """The int64 with the bits of float64 ``value``."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _placement(
    model: torch.nn.Module, batch: BatchState, cache: BatchKVCache, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [B, q], visible [B, 1, q, end])`` of ``input_ids`` ``[B, q]`` appended to ``cache``: the
    boolean visibility the fused integer forward takes (:func:`_visible`)."""
    start = cache.length
    end = start + input_ids.shape[1]
    return batch.position_ids(start, end), _visible(model, batch, start, end)


def _inputs(model: torch.nn.Module, batch: BatchState, cache: BatchKVCache, input_ids: torch.Tensor) -> dict:
    start = cache.length
    end = start + input_ids.shape[1]
    return {"input_ids": input_ids, "attention_mask": _mask(model, batch, start, end),
            "position_ids": batch.position_ids(start, end), cache_keyword(model): cache, "use_cache": True}


_BOOLEAN_MASKS = ("sdpa", EXACT_ATTENTION, INVARIANT_ATTENTION)


def _implementation(model: torch.nn.Module) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def _mask(model: torch.nn.Module, batch: BatchState, start: int, end: int) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of queries at columns ``start .. end-1`` over keys ``0 .. end-1``.

    For the ``sdpa`` and ``eager`` attention implementations it is the 4D mask transformers would build itself
    (``[B, 1, q, end]``: boolean for sdpa and the exact int8 attention, additive for eager; over the model's sliding
    window where it has one; one per layer kind where its layers mix them, :func:`as_mask`), which it then uses as
    is: building it here reads nothing back from the device (transformers checks whether a 2D mask has padding, a
    synchronisation). Other implementations get the 2D padding mask ``[B, end]``.
    """
    if _implementation(model) not in _BOOLEAN_MASKS and _implementation(model) != "eager":
        return batch.attention_mask(end)
    return as_mask(model, _visible(model, batch, start, end))


def _visible(model: torch.nn.Module, batch: BatchState, start: int, end: int) -> torch.Tensor:
    """``[B, 1, q, end]`` (bool): which keys ``0 .. end-1`` the queries at columns ``start .. end-1`` see, over the
    sliding window every layer of the model shares where it has one."""
    queries = torch.arange(start, end, device=batch.device)  # [q]
    return visible_keys(queries, batch.pad, end, attention_window(model.config))


def as_mask(model: torch.nn.Module, visible: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """``visible`` ``[B, 1, q, width]`` as the model's attention implementation takes a 4D mask (:func:`_as_4d`);
    for a model whose layers mix sliding and full attention (:attr:`~batchspec.families.Plan.sliding`), a mask per
    layer kind, as its own forward takes them: ``visible`` for the full layers, over the sliding window for the
    sliding ones (:func:`~batchspec.families.sliding_visible`)."""
    plan = plan_of(model.config)
    if plan.sliding is None:
        return _as_4d(model, visible)
    return {FULL: _as_4d(model, visible), SLIDING: _as_4d(model, sliding_visible(visible, plan.window))}


def _as_4d(model: torch.nn.Module, visible: torch.Tensor) -> torch.Tensor:
    """``visible`` ``[B, 1, q, width]`` as the model's attention implementation takes a 4D mask: boolean for sdpa
    and the exact int8 attention, additive for eager. Additive, a query that sees no key (padding) is left to see
    every key: eager attention takes its softmax in float32, where a float64 mask's minimum is ``-inf``, and a row of
    ``-inf`` alone would give the padding's keys and values in the layers after NaN. Padding columns may be laid out
    again under other rows' real ones (realign.py), where the mask hides them but NaN would not stay hidden."""
    if _implementation(model) in _BOOLEAN_MASKS:
        return visible
    dtype = next(model.parameters()).dtype
    hidden = ~visible & visible.any(-1, keepdim=True)  # [B, 1, q, width]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(hidden, torch.finfo(dtype).min)


def _static_call(
    model: torch.nn.Module,
    cache: BatchKVCache,
    input_ids: torch.Tensor,
    visible: torch.Tensor,
    positions: torch.Tensor,
    keep: int,
) -> torch.Tensor:
    """The model call of a static-mode forward (:mod:`batchspec.engine.graphs`): ``visible`` ``[B, 1, q, capacity]``,
    ``positions`` ``[B, q]``."""
    inputs = {"input_ids": input_ids, "attention_mask": as_mask(model, visible), "position_ids": positions}
    return model(**inputs, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=keep).logits


_CACHE_KEYWORDS: dict[type, str] = {}


def cache_keyword(model: torch.nn.Module) -> str:
    """The name a model's forward takes its KV cache by: ``cache`` in transformers versions that renamed it,
    ``past_key_values`` before."""
    kind = type(model)
    if kind not in _CACHE_KEYWORDS:
        parameters = inspect.signature(model.forward).parameters
        _CACHE_KEYWORDS[kind] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_KEYWORDS[kind]
