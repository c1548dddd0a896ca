"""Whether every load makes the same models: a preset loaded in ``--loads`` fresh processes, one after another, and
the hash of every weight, buffer and packed panel of its target and draft in each (the integer models' smoothing,
quantization, packing and rotary tables included). Prints one JSON line per load, then the count of distinct
hashes; writes them all to ``--output``. Nothing else should run beside it (a load takes 30-50 s on 2 cores).

    .venv/bin/python scripts/same_loads.py --preset qwen2.5-coder --quantize int8 --loads 25 --output loads.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch


def model_hash(model: torch.nn.Module) -> str:
    """sha1 over the model's state (parameters and buffers, by name), each packed weight's tensors and each rotary
    table's cos and sin, in module order."""
    digest = hashlib.sha1()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(_bytes(tensor))
    for _, module in model.named_modules():
        weight = getattr(module, "weight", None)
        for tensor in getattr(weight, "tensors", None) or ():
            digest.update(_bytes(tensor))
        for name in ("cos", "sin"):
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor):
                digest.update(_bytes(tensor))
    return digest.hexdigest()[:16]


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def one_load(preset: str, quantize: str) -> dict[str, str]:
    """The hashes of the preset's models (the pair where it has a draft, else its target alone), loaded here."""
    from batchspec.models import load_model, load_pair
    from batchspec.models.loading import PRESETS

    if "draft" not in PRESETS[preset].roles:
        return {"target": model_hash(load_model(f"{preset}:target", quantize=quantize, progress=False)[0])}
    pair = load_pair(preset=preset, quantize=quantize, progress=False)
    return {"target": model_hash(pair.target), "draft": model_hash(pair.draft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-coder")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--loads", type=int, default=10)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", action="store_true", help="load once in this process and print its hashes")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_load(args.preset, args.quantize)), flush=True)
        return
    loads = []
    for index in range(args.loads):
        command = [sys.executable, __file__, "--one", "--preset", args.preset, "--quantize", args.quantize]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        loads.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps({"load": index, **loads[-1]}), flush=True)
    distinct = sorted({json.dumps(load, sort_keys=True) for load in loads})
    summary = {"preset": args.preset, "quantize": args.quantize, "loads": loads, "distinct": len(distinct)}
    print(json.dumps({"loads": len(loads), "distinct": len(distinct)}))
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
