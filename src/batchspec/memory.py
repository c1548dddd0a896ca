"""The process's allocator settings for inference on the CPU.

glibc's ``malloc`` serves blocks of more than 32 MiB (at most; the threshold adapts from 128 KiB) with ``mmap`` and
returns them to the system when freed, so a forward whose activations are that large (a batch's prompts: qwen2.5-coder
1.5B's MLP holds ``[1200, 8960]`` float32, 43 MB) pays fresh page faults for each of them, every layer. Keeping freed
blocks in the heap for reuse, as caching allocators (jemalloc, tcmalloc) do, made the int8 prefill of 8 prompts of 150
tokens 1.35-1.7x faster (5.2-6.6 s to 3.8 s on an AMD EPYC Zen 5, 2 threads).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import resource
import sys
from collections.abc import Iterator

import torch

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks up to this size come from the heap and freed heap memory up to this size is kept
KEEP_BYTES = 1 << 30
# the most glibc's adaptive mmap threshold rises to on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX): where it stays
# while models load (returned_when_freed), and after, until keep_freed_memory raises it
LOAD_BLOCK_BYTES = 32 << 20


# the size of a huge page (x86-64 and aarch64 with 4 KiB pages): what weight_buffer aligns to and asks for
HUGE_PAGE = 2 << 20

# whether this Python can map anonymous memory and advise it for huge pages (Linux): where weight_buffer does
HUGE_PAGES_ADVISED = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")

# the most free memory the heap may hold resident between rounds before it is given back (HeapWatch)
HELD_FREE_BYTES = 128 << 20


class HeapWatch:
    """Bounds the free memory the heap keeps resident while rows run. Freed blocks stay in the heap for reuse
    (:func:`keep_freed_memory`), but they lie between live ones, so no trim threshold returns them: under a server's
    load the qwen2.5-coder pair held 1.1 GB of them beside 2.9 GB of live memory. :meth:`check`, between rounds,
    gives the heap's free memory back (:func:`give_back_freed_memory`) once the resident set has grown by more than
    ``held`` bytes (default :data:`HELD_FREE_BYTES`) since the last give-back, so the resident set stays within
    ``held`` of the live memory at some give-back: a prompt read's freed buffers go back after its round, a decode
    round that allocates what the last one freed costs one read of ``/proc/self/statm``. Does nothing where the
    resident set cannot be read or the C library is not glibc."""

    def __init__(self, held: int | None = None) -> None:
        self.held = HELD_FREE_BYTES if held is None else held
        self.resident: int | None = None  # after the last give-back
        self.reset()

    def reset(self) -> None:
        """Give the heap's free memory back and note the resident set after."""
        give_back_freed_memory()
        self.resident = resident_bytes() if _libc() is not None else None

    def check(self) -> bool:
        """Give the heap's free memory back if the resident set grew by more than ``held`` bytes since the last
        give-back; whether it did."""
        now = resident_bytes()
        if now is None or self.resident is None or now - self.resident <= self.held:
            return False
        self.reset()
        return True


def give_back_freed_memory() -> bool:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``): what a model's load freed in blocks the
    allocator kept (each layer's widened weights, read buffers) would otherwise stay resident. False where the C
    library is not glibc."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


@contextlib.contextmanager
def returned_when_freed() -> Iterator[None]:
    """Within: blocks of :data:`LOAD_BLOCK_BYTES` or more are mapped on their own and returned to the system when
    freed (the threshold fixed where glibc's adaptive one would rise to), and the quantization gives back the heap's
    free memory after each layer (:func:`give_back_freed_memory`); at the end once more, and the threshold is
    :data:`KEEP_BYTES` where :func:`keep_freed_memory` has run. Measured on the qwen2.5-coder pair's int8 load (Zen 4):
    peak 4.1 GB in 28-30 s; with 1 MiB blocks mapped 3.9 GB in 44-48 s (the calibration's activations faulted in
    afresh); without the trims 4.3 GB. Does nothing where the C library is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LOAD_BLOCK_BYTES)
    try:
        yield
    finally:
        if libc is not None:
            kept = keep_freed_memory.cache_info().currsize > 0
            libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES if kept else LOAD_BLOCK_BYTES)
            give_back_freed_memory()


def peak_resident_bytes() -> int:
    """The most memory this process has held resident so far (``ru_maxrss``: kilobytes on Linux, bytes on macOS),
    what ``/usr/bin/time -v`` reports as its maximum resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def resident_bytes() -> int | None:
    """The memory this process holds resident now (Linux's ``/proc/self/statm``), None where that is not known."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return None


def available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The memory the system could give this process now without swapping: Linux's ``MemAvailable`` (free memory
    plus the page cache and other memory it can reclaim), else the free pages alone (``SC_AVPHYS_PAGES``: on a host
    whose page cache fills its memory, a small part of what is available)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc's, or not glibc)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks below :data:`KEEP_BYTES` for reuse (once per process); False where the C library
    is not glibc. Called after the models are loaded, so the weights' own loading memory is still given back."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))


def weight_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for weights a decode step reads whole, held in huge pages where the system gives them.

    A step streams every weight from memory; in 4 KiB pages that is a page walk and a restart of the hardware
    prefetcher (which stops at a 4 KiB boundary) every 4 KiB. Measured on a 2-core Zen 4 (30 distinct weights of the
    MLP's 1536 x 8960 streamed, one row; ``docs/results/2026-11-28g-cpu/pages_product.json``): the int4 and int8
    products 13-17% faster from 2 MiB pages; the 1.5B target's plain step 1.32-1.45x its floor before, 1.03-1.14x
    with (``step_bins.jsonl``). Linux's transparent huge pages are asked for by ``madvise`` (its default policy gives
    them only so): the tensor starts on a huge page's boundary and every whole huge page of it is advised; the end
    that does not fill one stays in small pages, so nothing is held beyond the weight's bytes. Smaller weights, and
    systems without the advice (not Linux, or a kernel without transparent huge pages), get ``torch.empty``'s
    memory."""
    count = math.prod(shape) * dtype.itemsize
    if count < HUGE_PAGE or not HUGE_PAGES_ADVISED:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, count + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # [count + HUGE_PAGE]; keeps the mapping while a view lives
    start = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages: small pages, as torch's
        region.madvise(mmap.MADV_HUGEPAGE, start, count // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + count].view(dtype).view(shape)
