"""Ragged batches run directly through a model, against each row alone one token at a time: what the property
tests of exact modes (int8, batch-invariant) compare, and what ``scripts/gpu_check.py invariance`` counts on a GPU.
Needs torch, transformers and batchspec's runner (the name of the model call's cache argument, which transformers
renamed between versions)."""

from __future__ import annotations

import torch

from batchspec.engine.runner import cache_keyword


def alone_one_token_at_a_time(model, row: list[int]) -> torch.Tensor:
    """``[len(row), V]``: the logits of each position of ``row`` fed alone, one token per forward."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, out = DynamicCache(), []
    with torch.no_grad():
        for token in row:
            inputs = {"input_ids": torch.tensor([[token]], device=device), cache_keyword(model): cache}
            out.append(model(**inputs, use_cache=True).logits[0, -1])
    return torch.stack(out)


def ragged_forwards(model, rows: list[list[int]], prefix: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Run ``rows`` as one left-padded batch: a prefill of each row's first ``prefix[i]`` tokens, then forwards of
    ``steps[j]`` tokens each (rows out of tokens take filler columns); returns each row's logits of its own tokens."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    batch = len(rows)
    width = max(prefix)
    lead = [width - p for p in prefix]
    columns = [[0] * lead[i] + rows[i] + [0] * (width + sum(steps) - lead[i] - len(rows[i])) for i in range(batch)]
    real = [[lead[i] <= c < lead[i] + len(rows[i]) for c in range(len(columns[0]))] for i in range(batch)]
    real, ids, lead_t = (torch.tensor(v, device=device) for v in (real, columns, lead))
    cache, logits, start = DynamicCache(), [], 0
    with torch.no_grad():
        for stop in [width, *(width + sum(steps[: j + 1]) for j in range(len(steps)))]:
            keys = torch.arange(stop, device=device)
            queries = torch.arange(start, stop, device=device)
            visible = (keys[None, :] <= queries[:, None])[None] & real[:, None, :stop]
            positions = (queries[None] - lead_t[:, None]).clamp(min=0)
            out = model(ids[:, start:stop], attention_mask=visible[:, None], position_ids=positions,
                        **{cache_keyword(model): cache}, use_cache=True)
            logits.append(out.logits)
            start = stop
    everything = torch.cat(logits, dim=1)  # [B, columns, V]
    return [everything[i, lead[i] : lead[i] + len(rows[i])] for i in range(batch)]


def draw_ragged(data, vocab_size: int, max_batch: int, max_length: int) -> tuple[list[list[int]], list[int], list[int]]:
    """A ragged batch drawn with hypothesis' ``data``: ``(rows, prefix, steps)`` for :func:`ragged_forwards`, 1 to
    ``max_batch`` rows of 2 to ``max_length`` random tokens, each read ``prefix[i]`` tokens at first, then forwards of
    1 to 5 tokens until the longest row is done."""
    import torch
    from hypothesis import strategies as st

    batch = data.draw(st.integers(1, max_batch), label="batch")
    lengths = data.draw(st.lists(st.integers(2, max_length), min_size=batch, max_size=batch), label="lengths")
    prefix = [data.draw(st.integers(1, n - 1), label="prefix") for n in lengths]
    steps: list[int] = []
    while sum(steps) < max(n - p for n, p in zip(lengths, prefix, strict=True)):
        steps.append(data.draw(st.integers(1, 5), label="step"))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    rows = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    return rows, prefix, steps
