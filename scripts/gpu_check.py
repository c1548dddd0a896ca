"""What a developer with a GPU runs: equivalence, syncs per round, costs and throughput of batchspec on CUDA.

Models are built from configs with random weights (nothing is downloaded): tiny Llama / Qwen2 pairs in float32 for
exactness, and Qwen2.5-7B / Qwen2.5-0.5B shapes in bfloat16 for costs (random weights accept ~no drafts, so those
figures are of cost, not of acceptance). Each part prints a JSON object and writes it under ``--out``.

    python scripts/gpu_check.py equivalence     # tiny models, every method x proposer x k vs transformers' generate
    python scripts/gpu_check.py syncs           # device synchronisations per decode round, per configuration
    python scripts/gpu_check.py costs           # forward seconds of the 7B/0.5B shapes inside batchspec's runner
    python scripts/gpu_check.py throughput      # tokens/s vs transformers' generate (dynamic and static-cache compiled)
    python scripts/gpu_check.py invariance      # tiny models: rows bit-identical to themselves alone, mode off / on
    python scripts/gpu_check.py hybrid          # the hybrid proposer reading its lookups' hits, or not (7B/0.5B)
    python scripts/gpu_check.py all --out docs/results/DATE-gpu

``--batch-invariant`` runs every part's models on the batch-invariant kernels (``batchspec.exact.invariant``), and
``--tiny-dtype bfloat16`` the tiny models of ``equivalence`` in bfloat16 (issue 27's matrix: run it with and without
the mode). ``--cuda-graphs on`` runs batchspec's decode forwards as CUDA graphs in every part
(``batchspec.engine.graphs``; compare a run with ``off``, the default, written to another ``--out``).

A part can take minutes on a GPU (the 7B-shaped model is built in every part that uses it, and the static-cache
``generate`` compiles on its first call): run one part per command where commands are limited in time, and
``--sizes 8`` (or ``--sizes 1,8``) to split ``throughput`` further. ``--device cpu --small`` runs every part on the
CPU with small shapes (a smoke test of the script itself). ``scripts/gpu_session.sh`` runs the parts issue 39 asks
for, one after another, under one deadline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from host_reads import HostReads  # noqa: E402
from ragged import alone_one_token_at_a_time, ragged_forwards  # noqa: E402

import batchspec  # noqa: E402
from batchspec.engine.core import Engine  # noqa: E402
from batchspec.engine.graphs import graph_mode  # noqa: E402
from batchspec.engine.kv_cache import BatchKVCache  # noqa: E402
from batchspec.engine.proposers.draft import DraftModelProposer  # noqa: E402
from batchspec.engine.runner import ModelRunner  # noqa: E402
from batchspec.engine.state import BatchState  # noqa: E402
from batchspec.exact.invariant import make_batch_invariant  # noqa: E402

CONFIGS = [(m, p, k) for m in ("eqspec", "exspec") for p in ("draft", "ngram", "hybrid") for k in ("auto", 4)]
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064)
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=152064)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024)


def tiny(kind: str, seed: int, device: str, dtype: torch.dtype = torch.float32, invariant: bool = False):
    torch.manual_seed(seed)
    shape = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, initializer_range=0.3, tie_word_embeddings=False)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape)))
    model = model.to(device, dtype).eval()
    model.generation_config.eos_token_id = None  # no EOS: generate's min_new_tokens would mask it, batchspec does not
    return make_batch_invariant(model) if invariant else model


def shaped(shape: dict, seed: int, device: str, dtype: torch.dtype, invariant: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(**shape, tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    return make_batch_invariant(model) if invariant else model


def prompts(n: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=generator).tolist()
    body = [torch.randint(2, vocab, (length,), generator=generator).tolist() for length in lengths]
    return [p[: len(p) // 2] * 2 for p in body]  # repeated halves: prompt lookup finds drafts


def reference(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def equivalence(args) -> dict:
    results = {}
    for kind in ("llama", "qwen2"):
        dtype = getattr(torch, args.tiny_dtype)
        target, draft = (tiny(kind, seed, args.device, dtype, args.batch_invariant) for seed in (0, 1))
        rows = prompts(16, 96, 4, 40, seed=7)
        refs = [reference(target, p, 40) for p in rows]
        for method, proposer, k in CONFIGS:
            out = batchspec.generate(target, None if proposer == "ngram" else draft, rows, method=method,
                                     proposer=proposer, num_draft_tokens=k, max_new_tokens=40, eos_token_id=[],
                                     batch_size=8 if method == "eqspec" else 3, cuda_graphs=args.cuda_graphs)
            equal = sum(a == b for a, b in zip(out.sequences, refs, strict=True))
            results[f"{kind}/{method}/{proposer}/k={k}"] = f"{equal}/16"
        seeded = [batchspec.generate(target, draft, rows, method=m, batch_size=b, num_draft_tokens=k,
                                     temperature=0.9, seed=11, max_new_tokens=40, eos_token_id=[],
                                     cuda_graphs=args.cuda_graphs).sequences
                  for m, b, k in (("eqspec", 8, "auto"), ("exspec", 3, 2))]
        results[f"{kind}/seeded eqspec B=8 vs exspec B=3 k=2"] = (
            f"{sum(a == b for a, b in zip(*seeded, strict=True))}/16")
    return results


def syncs(args) -> dict:
    """Synchronisations per decode round: torch's sync detector on CUDA (each warning is one); elsewhere the
    round's device reads (:class:`host_reads.HostReads`), which are synchronisations on a GPU."""
    target, draft = tiny("llama", 0, args.device), tiny("llama", 1, args.device)
    rows = prompts(8, 96, 10, 30, seed=3)
    results = {}
    for method, proposer, temperature in [("autoregressive", None, 0.0)] + [
        ("eqspec", p, t) for p in ("draft", "ngram", "hybrid") for t in (0.0, 1.0)
    ]:
        rounds = []
        decode = Engine.decode

        def counted(engine, batch_rows, decode=decode, rounds=rounds):
            engine.runner.free_reads = False  # the GPU's policy, also where counted on the CPU
            with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
                warnings.simplefilter("always")
                decode(engine, batch_rows)
            cuda = engine.device.type == "cuda"
            rounds.append(sum("synchroniz" in str(w.message) for w in caught) if cuda else reads.count)

        Engine.decode = counted
        if args.device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("warn")
        try:
            batchspec.generate(target, None if proposer in (None, "ngram") else draft, rows, method=method,
                               proposer=proposer, num_draft_tokens=4, max_new_tokens=24, temperature=temperature,
                               seed=1, eos_token_id=[], batch_size=8)
        finally:
            Engine.decode = decode
            if args.device.startswith("cuda"):
                torch.cuda.set_sync_debug_mode("default")
        name = f"{method}/{proposer}/{'sampling' if temperature else 'greedy'}"
        results[name] = {"rounds": len(rounds), "syncs_per_round_max": max(rounds), "mean": sum(rounds) / len(rounds)}
    return results


def forward_seconds(model, runner: ModelRunner, size: int, context: int, tokens: int, repeats: int) -> float:
    """Seconds of one forward of ``tokens`` new columns per row after ``context`` cached ones, by CUDA events."""
    cache = BatchKVCache.for_model(model)
    batch = BatchState.dense(torch.randint(2, 1000, (size, context + tokens), device=runner.device), cache)
    with torch.inference_mode():
        runner.read(model, batch, cache, batch.tokens[:, :context])
        times = []
        for _ in range(repeats + 2):
            cache.crop(context)
            start = runner.mark()
            runner.logits(model, batch, cache, batch.tokens[:, context:], keep=tokens)
            end = runner.mark()
            runner.wait()
            times.append(runner.seconds(start, end))
    return sorted(times[2:])[len(times[2:]) // 2]


def costs(args) -> dict:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    runner = ModelRunner(torch.device(args.device), graphs=graph_mode(args.cuda_graphs, torch.device(args.device)))
    results = {}
    for name, shape in (("target-7B", QWEN_7B), ("draft-0.5B", QWEN_05B)):
        model = shaped(SMALL if args.small else shape, 0, args.device, dtype)
        for size in args.sizes:
            for tokens in (1, 5):
                seconds = forward_seconds(model, runner, size, 150, tokens, repeats=5 if args.small else 20)
                results[f"{name} B={size} tokens={tokens} ms"] = round(1000 * seconds, 3)
        del model
    for size in args.sizes:
        step = results[f"target-7B B={size} tokens=1 ms"]
        results[f"draft/target step B={size}"] = round(results[f"draft-0.5B B={size} tokens=1 ms"] / step, 3)
        verify = results[f"target-7B B={size} tokens=5 ms"]
        results[f"verify 5 tokens / 1 token, target B={size}"] = round(verify / step, 3)
    return results


def warm_up(target, draft, args) -> None:
    """One short run of each proposer, so that the first timed cell pays no library set-up (cuBLAS handles,
    kernels loaded on first use)."""
    rows = prompts(2, 1000, 20, 40, seed=0)
    for proposer in ("draft", "hybrid"):
        batchspec.generate(target, draft, rows, proposer=proposer, num_draft_tokens=4, batch_size=2, max_new_tokens=8,
                           eos_token_id=[], cuda_graphs=args.cuda_graphs)


PEERS = (("transformers generate", {}), ("transformers static compiled", {"cache_implementation": "static"}))


def throughput(args) -> dict:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = shaped(SMALL if args.small else QWEN_7B, 0, args.device, dtype, args.batch_invariant)
    draft = shaped(SMALL if args.small else QWEN_05B, 1, args.device, dtype, args.batch_invariant)
    new = 16 if args.small else args.new_tokens
    if args.cells != "peers":
        warm_up(target, draft, args)
    results = {}
    for size in args.sizes:
        rows = prompts(size, 1000, 100, 200, seed=size)
        cells = {
            "batchspec autoregressive": dict(method="autoregressive"),
            "batchspec default": dict(),
            "batchspec eqspec draft k=4": dict(proposer="draft", num_draft_tokens=4),
        }
        for name, options in cells.items() if args.cells != "peers" else ():
            started = time.perf_counter()
            out = batchspec.generate(target, draft, rows, batch_size=size, max_new_tokens=new, eos_token_id=[],
                                     cuda_graphs=args.cuda_graphs, **options)
            seconds = time.perf_counter() - started
            results[f"B={size} {name} tokens/s"] = round(sum(map(len, out.sequences)) / seconds, 1)
        for name, extra in PEERS if args.cells != "batchspec" else ():
            ids = torch.tensor([[0] * (max(map(len, rows)) - len(p)) + p for p in rows], device=args.device)
            mask = torch.tensor([[0] * (ids.shape[1] - len(p)) + [1] * len(p) for p in rows], device=args.device)
            call = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                        **extra)
            first = time.perf_counter()
            target.generate(ids, **call)
            results[f"B={size} {name} first call s"] = round(time.perf_counter() - first, 2)
            started = time.perf_counter()
            target.generate(ids, **call)
            results[f"B={size} {name} tokens/s"] = round(size * new / (time.perf_counter() - started), 1)
    return results


def hybrid(args) -> dict:
    """The hybrid proposer's two policies on the 7B/0.5B shapes (eqspec, k = 4): reading the device lookups' hits
    after a model-drafted token to skip draft forwards (``free_reads``, the CPU's policy) against running those
    forwards without reading (the GPU's): tokens/s and draft forwards of each, same tokens."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = shaped(SMALL if args.small else QWEN_7B, 0, args.device, dtype)
    draft = shaped(SMALL if args.small else QWEN_05B, 1, args.device, dtype)
    new = 16 if args.small else args.new_tokens
    warm_up(target, draft, args)
    results = {}
    init, step = ModelRunner.__init__, DraftModelProposer._model_step
    for size in args.sizes:
        rows = prompts(size, 1000, 100, 200, seed=size)
        outputs = {}
        for policy, free in (("read hits", True), ("no read", False)):
            def chosen(runner, *options, free=free, **named):
                init(runner, *options, **named)
                runner.free_reads = free

            forwards = []

            def counted(proposer, *inputs, forwards=forwards):
                forwards.append(1)
                return step(proposer, *inputs)

            ModelRunner.__init__, DraftModelProposer._model_step = chosen, counted
            try:
                started = time.perf_counter()
                out = batchspec.generate(target, draft, rows, proposer="hybrid", num_draft_tokens=4,
                                         batch_size=size, max_new_tokens=new, eos_token_id=[],
                                         cuda_graphs=args.cuda_graphs)
                seconds = time.perf_counter() - started
            finally:
                ModelRunner.__init__, DraftModelProposer._model_step = init, step
            outputs[policy] = out.sequences
            results[f"B={size} hybrid {policy} tokens/s"] = round(sum(map(len, out.sequences)) / seconds, 1)
            results[f"B={size} hybrid {policy} draft s"] = round(out.stats.draft_s, 3)
            results[f"B={size} hybrid {policy} rounds"] = out.stats.rounds
            results[f"B={size} hybrid {policy} draft forwards"] = len(forwards)
        results[f"B={size} same tokens"] = outputs["read hits"] == outputs["no read"]
    return results


def invariance(args) -> dict:
    """Tiny Llama / Qwen2 in ``--tiny-dtype``: of random ragged batches (left-padded rows of 2..24 tokens, forwards
    of 1..5 new tokens), the rows whose logits equal, bit for bit, their own alone one token at a time; without the
    batch-invariant mode and with it."""
    dtype = getattr(torch, args.tiny_dtype)
    generator = torch.Generator().manual_seed(5)
    results = {}
    for kind in ("llama", "qwen2"):
        for invariant in (False, True):
            model, same, total = tiny(kind, 0, args.device, dtype, invariant), 0, 0
            for _ in range(4 if args.small else 32):
                lengths = torch.randint(2, 25, (int(torch.randint(1, 5, (1,), generator=generator)),),
                                        generator=generator).tolist()
                prefix = [int(torch.randint(1, n, (1,), generator=generator)) for n in lengths]
                steps = []
                while sum(steps) < max(n - p for n, p in zip(lengths, prefix, strict=True)):
                    steps.append(int(torch.randint(1, 6, (1,), generator=generator)))
                rows = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in lengths]
                for row, got in zip(rows, ragged_forwards(model, rows, prefix, steps), strict=True):
                    same += int(torch.equal(got, alone_one_token_at_a_time(model, row)))
                    total += 1
            results[f"{kind} {args.tiny_dtype} mode {'on' if invariant else 'off'}"] = f"{same}/{total}"
    return results


PARTS = {"equivalence": equivalence, "syncs": syncs, "costs": costs, "throughput": throughput,
         "invariance": invariance, "hybrid": hybrid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "all"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (a smoke test on any device)")
    parser.add_argument("--out", type=Path, default=None, help="folder for PART.json files")
    parser.add_argument("--sizes", type=lambda text: [int(b) for b in text.split(",")], default=[1, 8, 32],
                        help="batch sizes of costs and throughput, comma-separated (default 1,8,32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt in throughput")
    parser.add_argument("--cells", choices=["all", "batchspec", "peers"], default="all",
                        help="throughput: batchspec's runs, transformers' generate, or both (default)")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="off", help="batchspec's CUDA graphs")
    parser.add_argument("--batch-invariant", action="store_true", help="models on the batch-invariant kernels")
    parser.add_argument("--tiny-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the tiny models (equivalence, invariance)")
    args = parser.parse_args()
    device = {"device": args.device, "name": torch.cuda.get_device_name(args.device)
              if args.device.startswith("cuda") else "cpu", "torch": torch.__version__, "cuda_graphs": args.cuda_graphs,
              "batch_invariant": args.batch_invariant, "tiny_dtype": args.tiny_dtype}
    for part in PARTS if args.part == "all" else [args.part]:
        result = {"part": part, **device, "results": PARTS[part](args)}
        print(json.dumps(result, indent=1), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{part}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
