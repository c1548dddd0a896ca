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
