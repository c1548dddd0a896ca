"""This host's integer peak, measured on the product kernels' own inner instruction streams, and the share of it that
the prompt-reading products reach (issue 76, item 3), for each native build this CPU runs::

    PYTHONPATH=src python scripts/integer_peak.py [--builds avx512vnni avx2] [--rows 240 1200] [--repeats 5] \\
        [--out peak.json]

**The peak** of a build is the rate of its kernels' inner loop with no memory traffic (``scripts/integer_peak.c``,
compiled when this runs with the package build's own compiler and flags, ``native._build_plan``, plus ``-DPEAK_*``).
Each stream is the arithmetic of the many-row (prompt-reading) micro-kernel of ``src/batchspec/exact/integer/csrc/``,
written as inline assembly so the compiler can neither fold, hoist nor spill it: the same instructions at the same
register width, the kernel's accumulators as independent chains (chained within a row as the kernel chains them), and
each memory operand (the weight's loads, the codes' broadcasts, the int4 weight's scales, mins, ``d``, ``dmin``)
replaced by a register already holding a value. A load or a broadcast from memory runs on the load ports (on Zen 4
and recent Intel cores a broadcast from memory is a load alone), beside the vector ALUs these instructions occupy, so
a stream without them is what the kernel's arithmetic can do at best on these cores: its ceiling once its data comes
for free. (The one exception: the avx2 build's int4 stream reloads one register a super-block, GCC's choice with 16
registers.)

* ``avx512vnni`` ``int8`` (``avx512.c``, ``panel_rows``): a step is 24 ``vpdpbusd`` zmm (4 weight vectors of 64
  outputs by 6 rows), 24 independent accumulators. ``vpdpbusd_zmm_12`` is docs/integer.md's ceiling, twelve
  independent ``vpdpbusd`` zmm chains and nothing else: the reference every build's share is also given against.
* ``amx`` ``int8`` (``avx512.c``'s ``tile_sums_pair``): a step is 4 ``tdpbusd`` (two tiles of codes by two of the
  weight, 16 x 16 x 64 multiply-adds each) into 4 tiles of sums, the input tiles loaded once; its ``int4`` and
  ``vpdpbusd_zmm_12`` are avx512vnni's (the amx build's int4 product is avx512vnni's).
* ``avx512vnni`` ``int4`` (``panel4_rows``, a super-block of 8 sub-blocks, 6 rows, 16 outputs): per step (8 inputs)
  the nibbles' unpacking (``vpandd``, ``vpsrlw``, ``vpandd``) and each row's two chained ``vpdpbusd``; per sub-block
  the scales' ``vpmovzxbd`` and each row's ``vpmulld``, ``vpaddd`` (and the zeroing ``vpxord``); per super-block each
  row's ``super_block_end`` (the mins' 4 x ``vpmovzxbw``, ``vpmaddwd``, ``vpaddd``; ``d`` and ``dmin``'s
  ``vcvtph2ps``; 2 ``vcvtdq2ps``, 3 ``vmulps``, ``vsubps``, ``vaddps``).
* ``avxvnni`` (``avx2.c`` with VNNI, 256-bit ``vpdpbusd``: VEX on AVX-VNNI CPUs, EVEX on AVX-512 VNNI ones, as the
  package builds it): ``int8`` 12 ``vpdpbusd`` ymm a step (2 weight vectors by 6 rows); ``int4`` as avx512vnni's on
  8 outputs and 4 rows (``half_panel4_rows``, d and dmin converted once a super-block as ``avx2.c`` does).
* ``avx2`` (``avx2.c`` without VNNI): ``int8`` per row and weight vector ``vpsignb``, ``vpmaddubsw``, ``vpmaddwd`` by
  ones, ``vpaddd`` (2 weight vectors by 4 rows); ``int4`` per row two ``vpmaddubsw`` and two ``vpaddw`` a step (3
  rows), the scales doubled into int16 pairs (``vpmovzxbd``, ``vpslld``, ``vpor``) and ``vpmaddwd``, ``vpaddd`` a
  sub-block.

**What is counted** (streams and products alike): 2 operations per multiply-add of an activation code by a weight
the product needs, so ``2 * rows * outputs * inputs`` for a product; a 512-bit ``vpdpbusd`` is 64 such multiply-adds
(128 operations), a 256-bit one or a ``vpmaddubsw`` ymm 32 (64). The unpacking, sign moves, pair sums, scales and
float steps count nothing: they are the overhead each stream carries, so a stream's rate is the most its kernel's
arithmetic can deliver, and the int4 stream's gap to ``vpdpbusd_zmm_12`` is what that overhead costs.

**Threads**: every stream runs in one OpenMP parallel region of ``--threads`` threads (default: torch's, which the
products use; 2 on a 2-core host), each thread its own copy of the loop, on the libgomp the package loads: the host's
whole peak, as the products run. The stream's time is that region's wall time; the best of ``--repeats`` runs of at
least ``--seconds`` each is its peak (interference only slows it), the median beside it.

**The products** are the package's own native calls (``native.linear_parts``, ``native.linear4``: the kernels the
fused forward runs for a prefill) on the 1.5B target's shapes (Qwen2.5-1.5B: hidden 1536, intermediate 8960; q, k,
v stacked as ``(1536, 256, 256)`` outputs, gate and up as ``(8960, 8960)``, o ``1536 -> 1536``, down
``8960 -> 1536``), random weights (int4: ``int4.from_float``'s Q4_K grid, super-blocks of 256) and activations quantized
as the forward quantizes them, at ``--rows`` rows (default 240 and 1,200: a short prompt and a long one), each weight
in enough copies (up to 32) that a pass over them reads at least 64 MB, twice a 32 MB L3: each call's weight comes
from memory, as in a forward over 28 layers. A product's calls are ``--repeats`` passes over its copies (or
as many calls as fit in 10 s, at least ``--repeats``).
Each product is timed alone, best and median of its calls; ``layer`` is the four products together (their operations
over their summed times). Measure on an idle host: a product call lasts milliseconds and its best can fall in a quiet
moment that a stream's run of ``--seconds`` cannot, so on a shared host a fraction can even pass 1. Each build runs in
its own process with ``BATCHSPEC_CPU_ISA`` set (native.py reads it once), with the allocator setting batchspec's
commands run under (:func:`batchspec.memory.keep_freed_memory`): each call's outputs reuse the last call's memory.
Without it, every output over 32 MiB (gate and up at 1,200 rows: 86 MB) was mapped afresh and its pages faulted in
on every call, and the int8 products at 1,200 rows measured 66% of their stream on a Zen 5 instead of 88%.

Output: JSON on stdout (or ``--out FILE``, the table then in ``FILE`` with ``.md``), and a markdown table on stderr
with each build's layer rate, its fraction of the build's own stream (``of_stream``) and of ``vpdpbusd_zmm_12``
(``of_vpdpbusd``). Progress on stderr. No model is needed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("integer_peak.c")
# the builds with a stream
MACROS = {"amx": "PEAK_AMX", "avx512vnni": "PEAK_AVX512", "avxvnni": "PEAK_AVXVNNI", "avx2": "PEAK_AVX2"}
REFERENCE = ("avx512vnni", "vpdpbusd_zmm_12")  # docs/integer.md's ceiling
# the 1.5B target's products in a decoder layer: (name, inputs, the stacked outputs' widths)
SHAPES = (("qkv", 1536, (1536, 256, 256)), ("o", 1536, (1536,)), ("gate_up", 1536, (8960, 8960)),
          ("down", 8960, (1536,)))
STREAM_BYTES = 64e6  # a pass over a shape's copies reads at least this much (twice this host's 32 MB L3)
MAX_COPIES = 32
CELL_SECONDS = 10.0  # a product's calls stop past this once it has had --repeats (the portable build's are long)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


# ---------------------------------------------------------------------------------------------------- the worker


def build_streams(build: str, directory: str) -> tuple[ctypes.CDLL, list[str]]:
    """The stream library of ``build``, compiled as the package compiles that build, plus its macro."""
    from batchspec.exact.integer import native

    compiler, flags, _, _ = native._build_plan(build)
    target = Path(directory) / f"integer_peak-{build}.so"
    command = [compiler, *flags, f"-D{MACROS[build]}", str(SOURCE), "-o", str(target)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    library = ctypes.CDLL(str(target))
    library.peak_name.restype = ctypes.c_char_p
    library.peak_ops.restype = ctypes.c_double
    library.peak_run.restype = ctypes.c_double
    library.peak_run.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    return library, command


def measure_streams(build: str, threads: int, repeats: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        library, command = build_streams(build, directory)
        streams = {}
        for i in range(library.peak_count()):
            name, ops = library.peak_name(i).decode(), library.peak_ops(i)
            iterations = 64
            while (elapsed := library.peak_run(i, iterations, threads)) < seconds:  # calibrated to run `seconds`
                iterations = int(iterations * min(16.0, max(2.0, 1.2 * seconds / max(elapsed, 1e-6))))
            times = [library.peak_run(i, iterations, threads) for _ in range(repeats)]
            rates = [threads * iterations * ops / t / 1e12 for t in times]
            streams[name] = {"ops_per_iteration": ops, "iterations": iterations, "TOP_per_s": round(max(rates), 4),
                             "median_TOP_per_s": round(statistics.median(rates), 4),
                             "seconds": [round(t, 4) for t in times]}
            log(f"  {build} stream {name}: {max(rates):.3f} TOP/s (median {statistics.median(rates):.3f})")
        return {"command": " ".join(command), "streams": streams}


def product_cells(width: str, rows: int, repeats: int, generator) -> list[dict]:
    """The four products of a layer at ``rows`` rows in ``width`` (int8 or int4), each timed alone."""
    import torch

    from batchspec.exact.integer import int4, native

    cells = []
    for name, inner, widths in SHAPES:
        outputs = sum(widths)
        x = torch.randn(rows, inner, generator=generator)
        if width == "int8":
            weight = native.pack(torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator))
            nbytes = weight[0].numel()
            codes, scale = native.quantize(x)  # the forward's quantization of the rows
            col = torch.rand(outputs, generator=generator) / 127

            def call(w, codes=codes, scale=scale, col=col, widths=widths):
                return native.linear_parts(codes, *w, scale, col, None, widths)
        else:
            weight = int4.from_float(torch.randn(outputs, inner, generator=generator) / 16).packed()
            nbytes = weight.numel()
            blocks = native.quantize_blocks(x, int4.SUB_BLOCK * int4.SUBS)

            def call(w, blocks=blocks, inner=inner, outputs=outputs, widths=widths):
                return native.linear4(blocks, w, inner, int4.SUBS, outputs, None, widths)
        copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / nbytes)))
        weights = [weight] + [tuple(t.clone() for t in weight) if isinstance(weight, tuple) else weight.clone()
                              for _ in range(copies - 1)]
        call(weights[0])  # warm: the library loaded, the pages touched
        times = []
        while len(times) < repeats * copies and (len(times) < repeats or sum(times) < CELL_SECONDS):
            w = weights[len(times) % copies]
            started = time.perf_counter()
            call(w)
            times.append(time.perf_counter() - started)
        ops = 2 * rows * outputs * inner
        best, median = min(times), statistics.median(times)
        cells.append({"width": width, "rows": rows, "shape": name, "inputs": inner, "outputs": list(widths),
                      "weight_MB": round(nbytes / 1e6, 2), "copies": copies, "calls": len(times), "ops": ops,
                      "ms": round(1e3 * best, 3), "median_ms": round(1e3 * median, 3),
                      "TOP_per_s": round(ops / best / 1e12, 4), "median_TOP_per_s": round(ops / median / 1e12, 4)})
        log(f"  {native.isa()} {width} {rows} rows {name}: {ops / best / 1e12:.3f} TOP/s "
            f"(median {ops / median / 1e12:.3f}, {len(times)} calls)")
    return cells


def worker(arguments: argparse.Namespace) -> None:
    import torch

    from batchspec.exact.integer import native
    from batchspec.memory import keep_freed_memory

    keep_freed_memory()  # as the commands run: outputs reuse freed memory, no fresh pages each call
    build = arguments.worker
    if native.isa() != build:
        raise SystemExit(f"asked for the {build} build, running {native.isa()}")
    torch.set_num_threads(arguments.threads)
    result = {"build": build, "threads": torch.get_num_threads()}
    if build in MACROS:
        result.update(measure_streams(build, arguments.threads, arguments.repeats, arguments.seconds))
    if not arguments.peak_only:
        generator = torch.Generator().manual_seed(0)
        result["products"] = [cell for width in ("int8", "int4") for rows in arguments.rows
                              for cell in product_cells(width, rows, arguments.repeats, generator)]
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- the parent


def run_worker(build: str, arguments: argparse.Namespace, peak_only: bool) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", build, "--threads", str(arguments.threads),
               "--repeats", str(arguments.repeats), "--seconds", str(arguments.seconds),
               "--rows", *map(str, arguments.rows)] + (["--peak-only"] if peak_only else [])
    env = {**os.environ, "BATCHSPEC_CPU_ISA": build}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"the {build} worker failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def share(value: float, peak: float | None) -> float | None:
    return round(value / peak, 3) if peak else None


def summarize(results: dict, reference: float | None) -> dict:
    """Each build's layers (the four products together per width and rows) and every cell's shares of the peaks."""
    for result in results.values():
        streams = result.get("streams", {})
        for cell in result.get("products", []):
            own = streams.get(cell["width"], {}).get("TOP_per_s")
            cell["of_stream"] = share(cell["TOP_per_s"], own)
            cell["of_vpdpbusd"] = share(cell["TOP_per_s"], reference)
        layers = []
        keys = sorted({(c["width"], c["rows"]) for c in result.get("products", [])},
                      key=lambda k: (k[0] != "int8", k[1]))
        for width, rows in keys:
            cells = [c for c in result["products"] if (c["width"], c["rows"]) == (width, rows)]
            ops = sum(c["ops"] for c in cells)
            rate = ops / sum(c["ms"] for c in cells) / 1e9
            median = ops / sum(c["median_ms"] for c in cells) / 1e9
            own = streams.get(width, {}).get("TOP_per_s")
            layers.append({"width": width, "rows": rows, "TOP_per_s": round(rate, 4),
                           "median_TOP_per_s": round(median, 4), "stream_TOP_per_s": own,
                           "of_stream": share(rate, own), "of_vpdpbusd": share(rate, reference)})
        result["layer"] = layers
    return results


def markdown(report: dict) -> str:
    reference = report["vpdpbusd_peak_TOP_per_s"]
    lines = [f"{report['host']['cpu']}, {report['host']['threads']} threads; `vpdpbusd_zmm_12` peak: "
             + (f"{reference:.3f} TOP/s" if reference else "not measured (no AVX-512 VNNI)"), "",
             "| build | width | rows | products TOP/s (median) | stream peak TOP/s | of stream | of vpdpbusd |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for build, result in report["builds"].items():
        for layer in result.get("layer", []):
            stream = layer["stream_TOP_per_s"]
            lines.append(f"| {build} | {layer['width']} | {layer['rows']} | {layer['TOP_per_s']:.3f} "
                         f"({layer['median_TOP_per_s']:.3f}) | {f'{stream:.3f}' if stream else '-'} | "
                         f"{layer['of_stream'] if layer['of_stream'] is not None else '-'} | "
                         f"{layer['of_vpdpbusd'] if layer['of_vpdpbusd'] is not None else '-'} |")
    return "\n".join(lines) + "\n"


def main(arguments: argparse.Namespace) -> None:
    from batchspec.exact.integer import native

    host = native.host_isas()
    builds = arguments.builds or list(host)
    skipped = [b for b in builds if b not in host]
    if skipped:  # e.g. avxvnni on a CPU with neither AVX-VNNI nor AVX-512 VNNI
        log(f"skipped: this CPU does not run {', '.join(skipped)} (it runs {', '.join(host)})")
    builds = [b for b in builds if b in host]
    if not builds:
        raise SystemExit("none of the builds asked for runs on this CPU")
    results = {}
    for build in builds:
        log(f"{build}: streams and products ({arguments.threads} threads)")
        results[build] = run_worker(build, arguments, peak_only=False)
    reference = None
    if REFERENCE[0] in host:
        if REFERENCE[0] not in results:
            log(f"{REFERENCE[0]}: the vpdpbusd reference stream only")
            results_reference = run_worker(REFERENCE[0], arguments, peak_only=True)
        else:
            results_reference = results[REFERENCE[0]]
        reference = results_reference["streams"][REFERENCE[1]]["TOP_per_s"]
    report = {
        "issue": "76, item 3: prompt reading at the limit",
        "host": {"cpu": host_cpu(), "machine": platform.machine(), "threads": arguments.threads,
                 "builds_this_cpu_runs": list(host), "load_average": list(os.getloadavg())},
        "counted": "2 operations per multiply-add of an activation code by a weight (vpdpbusd zmm: 128, ymm: 64)",
        "rows": arguments.rows, "repeats": arguments.repeats, "skipped": skipped,
        "vpdpbusd_peak_TOP_per_s": reference,
        "builds": summarize(results, reference),
    }
    text = json.dumps(report, indent=1)
    table = markdown(report)
    if arguments.out:
        Path(arguments.out).write_text(text + "\n")
        Path(arguments.out).with_suffix(".md").write_text(table)
    else:
        print(text)
    log(table)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--builds", nargs="+", help="native builds to measure (default: every build this CPU runs)")
    parser.add_argument("--rows", nargs="+", type=int, default=[240, 1200], help="prompt rows (default: 240 1200)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each stream, passes of each product")
    parser.add_argument("--seconds", type=float, default=0.3, help="the shortest run of a stream (default 0.3 s)")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: torch's, as the products use)")
    parser.add_argument("--out", help="write the JSON here (and the markdown table beside it, .md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one build's measurements, in its own process
    parser.add_argument("--peak-only", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.threads is None:
        import torch

        arguments.threads = torch.get_num_threads()
    if arguments.repeats < 1 or arguments.seconds <= 0 or any(r < 1 for r in arguments.rows):
        parser.error("--repeats, --seconds and --rows take positive values")
    return arguments


if __name__ == "__main__":
    parsed = parse()
    if parsed.worker:
        worker(parsed)
    else:
        main(parsed)
