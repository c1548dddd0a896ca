"""Issue 61: an A/B of variants of csrc/avx512.c's int4 product (batchspec_linear4) in one process, alternated 7
times: each variant a copy of avx512.c (with scalar.h and entry.h beside it) at /tmp/ab/avx512_<name>.c, compiled with
the build's flags, called through ctypes on the same operands; int8 TOP/s on one cache-resident 1536 -> 2048 weight
(compute-bound) and on 20 distinct 1536 -> 8960 ones streamed from memory, for 1, 5, 8, 40 and 64 rows:

    PYTHONPATH=src python docs/results/2026-11-28-cpu/kernel_ab.py h i     # /tmp/ab/avx512_h.c against avx512_i.c

The variants measured (edits of the kernel of their day): two panels a pass against one; the codes' broadcast folded
into vpdpbusd's memory operand ({1to16}); 4, 6, 8 and 10 rows a pass; no unpacking and no sc scaling (wrong sums, to
see what each costs). The host's speed moved by 2x between runs; only figures of one run are compared.
"""

import ctypes
import statistics
import subprocess
import sys
import time

import torch

from batchspec.exact.integer import int4, native

FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512vnni", "-mf16c"]
torch.set_num_threads(2)
native.library()  # loads libgomp as the package does


def compiled(name: str):
    so = f"/tmp/ab/{name}.so"
    subprocess.run(["gcc", *FLAGS, f"/tmp/ab/avx512_{name}.c", "-o", so], check=True)
    function = ctypes.CDLL(so).batchspec_linear4
    function.argtypes, function.restype = native._signatures()["linear4"], None
    return function


def call(function, rows, packed: torch.Tensor, inner: int, outputs: int) -> torch.Tensor:
    codes, scales, sums = rows
    out = torch.empty(codes.shape[0], outputs)
    starts, pointers = (ctypes.c_int64 * 2)(0, outputs), (ctypes.c_void_p * 1)(out.data_ptr())
    function(codes.data_ptr(), codes.shape[0], codes.shape[1], scales.data_ptr(), scales.shape[1], sums.data_ptr(),
             sums.shape[1], packed.data_ptr(), packed.shape[1], packed.shape[0], -(-inner // 32), 8, outputs, None,
             pointers, starts, 1, None, 2)
    return out


def main() -> None:
    variants = {name: compiled(name) for name in sys.argv[1:]}
    generator = torch.Generator().manual_seed(0)
    for outputs, inner, count in ((2048, 1536, 1), (8960, 1536, 20)):
        weights = [int4.from_float(torch.randn(outputs, inner, generator=generator)).packed() for _ in range(count)]
        for n in (1, 5, 8, 40, 64):
            rows = native.quantize_blocks(torch.randn(n, inner, generator=generator), 256)
            outs = [call(f, rows, weights[0], inner, outputs) for f in variants.values()]
            same = all(torch.equal(outs[0], out) for out in outs)
            seconds = {name: [] for name in variants}
            calls = max(count, 10)
            for _ in range(7):
                for name, function in variants.items():
                    started = time.perf_counter()
                    for i in range(calls):
                        call(function, rows, weights[i % count], inner, outputs)
                    seconds[name].append((time.perf_counter() - started) / calls)
            rates = " ".join(f"{name}: {2 * outputs * inner * n / statistics.median(s) / 1e12:.3f} TOP/s"
                             for name, s in seconds.items())
            kind = "cached" if count == 1 else "streamed"
            print(outputs, inner, kind, n, rates, "" if same else "(the variants' outputs differ)", flush=True)


main()
