"""Which float32 CPU ops give a row a result that depends on the rest of the batch (for issue 26's design): each
op's output for one row alone against the same row inside a larger call, bit for bit, 2 threads. Prints one JSON
line.

    python docs/results/2026-11-24d/op_invariance.py
"""

import json

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
hidden, heads, dim = 576, 9, 64  # smollm2's shapes
x = torch.randn(17, hidden, generator=g)
weight = torch.randn(1536, hidden, generator=g)


def rms(t: torch.Tensor) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)


results = {
    "linear (row 0 alone vs in 17)": torch.equal(F.linear(x[:1], weight), F.linear(x, weight)[:1]),
    "linear (row 0 alone vs in 5)": torch.equal(F.linear(x[:1], weight), F.linear(x[:5], weight)[:1]),
    "rmsnorm (row 0 alone vs in 17)": torch.equal(rms(x[:1]), rms(x)[:1]),
    "softmax (row 0 alone vs in 17)": torch.equal(torch.softmax(x[:1], -1), torch.softmax(x, -1)[:1]),
}
keys = torch.randn(1, heads, 40, dim, generator=g)
values = torch.randn(1, heads, 40, dim, generator=g)
queries = torch.randn(1, heads, 5, dim, generator=g)
last = F.scaled_dot_product_attention(queries[:, :, -1:], keys, values)  # the last query alone, 40 keys
causal = torch.ones(5, 40, dtype=torch.bool).tril(35)
block = F.scaled_dot_product_attention(queries, keys, values, attn_mask=causal)[:, :, -1:]  # inside a 5-query block
padded_keys = torch.cat([torch.zeros(1, heads, 20, dim), keys], 2)
padded_values = torch.cat([torch.zeros(1, heads, 20, dim), values], 2)
mask = (torch.arange(60) >= 20)[None, :]  # [1, 60]
padded = F.scaled_dot_product_attention(queries[:, :, -1:], padded_keys, padded_values, attn_mask=mask)
results["sdpa (last query alone vs in a 5-query causal block)"] = torch.equal(last, block)
results["sdpa (40 keys vs the same keys after 20 masked padding keys)"] = torch.equal(last, padded)
print(json.dumps({k: bool(v) for k, v in results.items()}))
