"""The plain B = 1 step of every family at about 1B parameters against its floor: the bytes the step reads over the
read bandwidth measured beside it (issue 77).

    python scripts/family_floor.py [--families llama,qwen3_moe] [--quantize int8,int4] [--out floor.json]
        [--layers 16] [--vocab 64000] [--context 200] [--repeats 9] [--window 128] [--dtype bfloat16] [--threads N]

For each family × width: a random-weight model (:func:`batchspec.bench.shapes.random_model`: seeded N(0, 0.02)
matrices, no transformers initialization) of the shape below with the family's departures on
(:mod:`batchspec.bench.shapes`), quantized as the engine does (:func:`batchspec.exact.integer.quantize_model`), then:

* ``step_s``: the median of ``--repeats`` one-token forwards of one row after ``--context`` cached tokens, through
  batchspec's model runner (:func:`batchspec.bench.costs.time_forward`); ``forward`` says which forward ran it
  (:func:`~batchspec.exact.integer.forward_in_use`: ``fused`` is :class:`IntegerForward`, anything else
  transformers' forward, and the ratio is then not the fused forward's);
* ``bytes``: ``weight_bytes`` (:func:`batchspec.bench.costs.weight_bytes`: every parameter, buffer and packed integer
  weight once, the input embedding table looked up, not read) less, for a mixture, the experts the step did not run
  (each sparse block's ``touched`` after the timed step: the union of the experts it read, top k a layer at B = 1),
  plus the KV cache the step's attention reads (``kv_bytes``: int16 keys and values of ``packed_width`` a head, each
  layer over its window); ``product_bytes`` (:func:`batchspec.exact.integer.moe.forward_bytes`) is the integer
  weights alone, a check;
* ``bandwidth``: :func:`batchspec.bench.costs.read_bandwidth` of the CPU just before and just after the step's timing
  (both kept; their mean used), as the host's bandwidth moves by 2x from minute to minute;
* ``floor_s`` = ``bytes / bandwidth``, ``ratio`` = ``step_s / floor_s`` (the target: at most 1.2).

The shape: hidden 2048, 16 layers, 16 query heads of 128, 4 key/value heads, MLP 5632, vocabulary 64,000 (0.98B
parameters untied, 0.85B tied: Phi-3, the Gemmas); each mixture 8 experts of 2816 inner values, top 2 (1.0B active,
2.6B in all; Qwen3-MoE's second layer dense, its MLP 5632). Sliding layers (Ministral's and the Gemmas' even ones,
Mixtral's all) attend over ``--window`` keys, 128 by default so that they see fewer than the context.

The float model is built in ``--dtype`` (bfloat16 by default, as checkpoints are held: a mixture's 2.6B parameters
would be 10.6 GB in float32; quantization widens a layer at a time) and freed before the next one. Seen on a shared
2-vCPU host, int8, ``--threads 1``: Llama 50 s (build 11 s, quantization 33 s, measuring 6 s), peak 3.2 GB resident;
Qwen3-MoE 93 s (20 s, 66 s, 7 s), peak 7.5 GB (``peak_rss_gb``: the process's peak so far); with two threads on that
host under a load of 5-10, 2.5 and 5 minutes, and 7.8 GB.
Progress on stderr; a markdown table on stdout; one JSON record per family × width in ``--out``.

Run it alone on the host: the kernels' threads wait for each other at every layer, so on a host whose other work
takes the cores a step of two threads takes many times its floor (seen on a loaded 2-vCPU host: 176-400 ms for a
two-layer model whose step takes 9 ms with ``--threads 1``). ``read_bandwidth`` reads with as many threads as the
step runs on; one thread's sum read below what one thread's step did there (the ratios came out 0.8-0.85).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from batchspec.bench.costs import idle_expert_bytes, read_bandwidth, time_forward, weight_bytes
from batchspec.bench.shapes import FAMILY_NAMES, MIXTURES, family_config, random_model
from batchspec.exact.integer import forward_in_use, quantize_model
from batchspec.exact.integer.moe import forward_bytes
from batchspec.exact.integer.native import packed_width
from batchspec.families import plan_of
from batchspec.memory import give_back_freed_memory, keep_freed_memory, returned_when_freed

HIDDEN, HEADS, KV_HEADS, HEAD, MLP = 2048, 16, 4, 128, 5632
EXPERTS, TOP_K = 8, 2
SEED = 77


def shape(family: str, layers: int, vocab: int, window: int) -> dict:
    """The keyword arguments of ``family``'s ~1B config (module docstring) with ``layers`` layers, a vocabulary of
    ``vocab`` and sliding layers over ``window`` keys."""
    kw = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, head_dim=HEAD, intermediate_size=MLP, max_position_embeddings=4096,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no family's own ids, past the vocabulary
    if family in ("ministral", "gemma2", "gemma3", "mixtral"):
        kw["sliding_window"] = window
    if family in ("gemma2", "gemma3"):
        kw["query_pre_attn_scalar"] = 2 * HEAD
    if family == "gemma2":
        kw.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "qwen3_moe":
        kw.update(num_experts=EXPERTS, moe_intermediate_size=MLP // 2, num_experts_per_tok=TOP_K)
    elif family == "olmoe":
        kw.update(num_experts=EXPERTS, intermediate_size=MLP // 2, num_experts_per_tok=TOP_K)
    elif family == "mixtral":
        kw.update(num_local_experts=EXPERTS, intermediate_size=MLP // 2, num_experts_per_tok=TOP_K)
    return kw


def parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(all, active)`` parameters of a float model: a one-token step runs ``num_experts_per_tok`` of each sparse
    block's experts (transformers' 3-D ``experts.*`` parameters, every expert of one size)."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    total = active = 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        share = config.num_experts_per_tok / experts if experts and ".experts." in name else 1.0
        active += round(parameter.numel() * share)
    return total, active


def kv_bytes(model: torch.nn.Module, context: int) -> int:
    """Bytes of keys and values a one-token step's attention reads after ``context`` cached tokens: int16 of
    ``packed_width`` a head, each layer over its window (a sliding layer's) or everything before it."""
    config = model.config.get_text_config()
    recipe = plan_of(config)
    sliding = recipe.sliding or (True,) * config.num_hidden_layers  # None: every layer over the window, if any
    seen = min(recipe.window or context + 1, context + 1)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys = sum(seen if slides else context + 1 for slides in sliding)
    return keys * 2 * config.num_key_value_heads * packed_width(head) * 2


def bandwidth() -> float:
    """The CPU's read bandwidth now, bytes/s; its 1 GiB buffer given back at once."""
    measured = read_bandwidth("cpu")
    gc.collect()
    give_back_freed_memory()
    return measured


def measure(model: torch.nn.Module, context: int, repeats: int) -> dict:
    """The step, the bandwidth beside it and the bytes it read (module docstring) of a quantized ``model``."""
    before = bandwidth()
    step = time_forward(model, 1, 1, context, repeats)
    after = bandwidth()
    weights, idle = weight_bytes(model), idle_expert_bytes(model)
    kv = kv_bytes(model, context)
    read = weights - idle + kv
    mean = statistics.mean([before, after])
    return {"forward": forward_in_use(model), "step_s": step, "weight_bytes": weights, "idle_expert_bytes": idle,
            "kv_bytes": kv, "bytes": read, "product_bytes": forward_bytes(model), "bandwidth_before": before,
            "bandwidth_after": after, "bandwidth": mean, "floor_s": read / mean, "ratio": step * mean / read}


def one(family: str, width: str, args: argparse.Namespace) -> dict:
    """Build, quantize and measure one family at one width; every model freed before returning."""
    started = time.perf_counter()
    config = family_config(family, **shape(family, args.layers, args.vocab, args.window))
    with returned_when_freed():  # as a model's load is (batchspec.models.loading), then memory kept as after it
        model = random_model(config, seed=SEED, dtype=getattr(torch, args.dtype))
        total, active = parameters(model)
        built = time.perf_counter()
        quantize_model(model, width=width)
        gc.collect()
    keep_freed_memory()
    quantized = time.perf_counter()
    record = {"family": family, "width": width, "params": total, "active_params": active, "layers": args.layers,
              "vocab": args.vocab, "context": args.context, "repeats": args.repeats, "dtype": args.dtype,
              **measure(model, args.context, args.repeats)}
    del model
    gc.collect()
    give_back_freed_memory()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GB: the process's peak so far
    record.update(build_s=built - started, quantize_s=quantized - built, measure_s=time.perf_counter() - quantized,
                  peak_rss_gb=peak, threads=torch.get_num_threads())
    return record


def table(records: list[dict]) -> str:
    """The records as a markdown table."""
    lines = ["| family | width | params | active params | bytes read | bandwidth | step | floor | ratio | forward |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in records:
        lines.append(f"| {r['family']} | {r['width']} | {r['params'] / 1e9:.2f}B | {r['active_params'] / 1e9:.2f}B "
                     f"| {r['bytes'] / 1e9:.3f} GB | {r['bandwidth'] / 1e9:.1f} GB/s | {r['step_s'] * 1e3:.1f} ms "
                     f"| {r['floor_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x | {r['forward']} |")
    return "\n".join(lines)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILY_NAMES), help="comma-separated; default: all")
    parser.add_argument("--quantize", default="int8", help="widths, comma-separated: int8, int4")
    parser.add_argument("--out", type=Path, help="JSON file of the records")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (fewer for a quick check)")
    parser.add_argument("--vocab", type=int, default=64_000)
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the timed step")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps (their median)")
    parser.add_argument("--window", type=int, default=128, help="the sliding layers' window")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the float model's")
    parser.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0: torch's own")
    args = parser.parse_args(argv)
    args.families, args.quantize = args.families.split(","), args.quantize.split(",")
    unknown = [f for f in args.families if f not in FAMILY_NAMES] + [w for w in args.quantize if w not in
                                                                      ("int8", "int4")]
    if unknown:
        parser.error(f"unknown families or widths: {unknown}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every family × width asked for, one after another, writing ``--out`` after each."""
    args = arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    plan = [(family, width) for family in args.families for width in args.quantize]
    for family, width in (bar := tqdm(plan, file=sys.stderr, unit="model")):
        bar.set_description(f"{family} {width}")
        records.append(one(family, width, args))
        tqdm.write(json.dumps(records[-1]), file=sys.stderr)
        if args.out is not None:
            args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    mixtures = [r["family"] for r in records if r["family"] in MIXTURES]
    if mixtures:
        print(f"\n{', '.join(sorted(set(mixtures)))}: bytes read are the experts each sparse block ran (top "
              f"{TOP_K} of {EXPERTS}).")


if __name__ == "__main__":
    main()
