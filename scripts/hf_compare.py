"""``batchspec.hf_generate`` next to ``model.generate`` on one left-padded batch; prints JSON.

    python scripts/hf_compare.py [PRESET] [PROMPTS] [NEW_TOKENS]     # defaults: smollm2 8 64

Both models in float32 on PyTorch's default kernels; the prompts are the first HumanEval problems through the chat
template. Reports both wall times, whether every row of ``hf_generate``'s tensor equals ``model.generate``'s, and
what transformers' own assisted ``generate`` does with the batch.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import batchspec
from batchspec.data.prompts import load_prompts
from batchspec.models import load_pair


def main(preset: str = "smollm2", prompts: int = 8, new_tokens: int = 64) -> dict:
    pair = load_pair(preset, dtype="float32", kernels="default", quantize="none", progress=False)
    tokenizer = pair.tokenizer
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r.text}], tokenize=False, add_generation_prompt=True)
        for r in load_prompts("humaneval", limit=prompts)
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    report: dict = {"preset": preset, "prompts": prompts, "max_new_tokens": new_tokens}
    with torch.inference_mode():
        first = {k: v[:1] for k, v in inputs.items()}  # warm-up
        batchspec.hf_generate(pair.target, **first, assistant_model=pair.draft, max_new_tokens=4)
        pair.target.generate(**first, max_new_tokens=4, do_sample=False)
        started = time.perf_counter()
        reference = pair.target.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        report["model_generate_s"] = time.perf_counter() - started
        started = time.perf_counter()
        ours = batchspec.hf_generate(
            pair.target, **inputs, assistant_model=pair.draft, max_new_tokens=new_tokens, do_sample=False
        )
        report["hf_generate_s"] = time.perf_counter() - started
        try:
            pair.target.generate(**inputs, assistant_model=pair.draft, max_new_tokens=new_tokens, do_sample=False)
            report["transformers_batched_assisted"] = "ran"
        except ValueError as error:
            report["transformers_batched_assisted"] = f"ValueError: {error}"
    report["same_shape"] = reference.shape == ours.shape
    if report["same_shape"]:
        report["rows_equal"] = [bool(torch.equal(a, b)) for a, b in zip(reference, ours, strict=True)]
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(*(args[:1] + [int(a) for a in args[1:3]]))))
