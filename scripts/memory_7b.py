"""The memory a 7B-class model takes to load in int8: a checkpoint of Qwen2.5-7B's shape, random bf16 weights written
to disk a layer at a time (no download), loaded with ``--quantize int8`` in a process of its own; one JSON line.

    python scripts/memory_7b.py write DIR [--tokenizer-from DIR]   # 15.2 GB of shards, about a minute
    python scripts/memory_7b.py load DIR                            # {"peak_rss_gb", "held_gb", "peak_over_held", ...}

``held_gb`` is what the loaded model holds (every parameter, buffer and packed integer weight, each storage once):
the int8 linear layers, the int8 output layer and the bf16 input embedding. The peak is ``ru_maxrss``, the process's
maximum resident set. ``tests/test_memory.py`` runs both (a large test: set BATCHSPEC_LARGE_TESTS=1).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import torch

# Qwen2.5-7B-Instruct's shape (its config.json), untied output layer
SHAPE = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")


def layer_tensors(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer ``index``'s weights: normal(0, 0.02) linear weights and biases, norms of ones, in bf16."""
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["hidden_size"] // 7  # 4 of 28 heads

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    p = f"model.layers.{index}."
    return {
        p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.q_proj.bias": normal(h),
        p + "self_attn.k_proj.weight": normal(kv, h), p + "self_attn.k_proj.bias": normal(kv),
        p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.v_proj.bias": normal(kv),
        p + "self_attn.o_proj.weight": normal(h, h),
        p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
        p + "mlp.down_proj.weight": normal(h, i),
        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
    }


def write(directory: Path, tokenizer_from: Path | None) -> dict:
    """The checkpoint: one safetensors shard per layer (and one for the embeddings, norm and head) and its index."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator, weight_map, start = torch.Generator().manual_seed(7), {}, time.perf_counter()
    v, h = SHAPE["vocab_size"], SHAPE["hidden_size"]
    shards = [lambda: {"model.embed_tokens.weight": (torch.randn(v, h, generator=generator) * 0.02).bfloat16(),
                       "lm_head.weight": (torch.randn(v, h, generator=generator) * 0.02).bfloat16(),
                       "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}]
    shards += [lambda index=index: layer_tensors(index, generator) for index in range(SHAPE["num_hidden_layers"])]
    for number, make in enumerate(shards):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = make()
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(SHAPE, indent=1))
    for file in TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / file).exists():
            shutil.copy(tokenizer_from / file, directory / file)
    return {"written_gb": sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9,
            "seconds": time.perf_counter() - start}


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, buffer and packed integer weight of ``model``, each storage once."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += list(getattr(getattr(module, "weight", None), "tensors", ()))
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def load(directory: Path) -> dict:
    from batchspec.models import loading

    start = time.perf_counter()
    model, _ = loading.load_model(str(directory), quantize="int8", progress=False)
    seconds = time.perf_counter() - start
    peak, held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, held_bytes(model)
    return {"peak_rss_gb": round(peak / 1e9, 3), "held_gb": round(held / 1e9, 3),
            "peak_over_held": round(peak / held, 3), "load_seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("write", "load"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    args = parser.parse_args()
    result = write(args.directory, args.tokenizer_from) if args.action == "write" else load(args.directory)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
