"""The decoding core: one round of batch speculative decoding, module by module in the order a round uses them.

- ``state``, ``kv_cache``: the batch's layout (Sequence, BatchState) and its KV caches (BatchKVCache, Slab).
- ``runner``, ``graphs``: every forward, staging of the round's host numbers and its one device→host read;
  CUDA graphs of the decode forwards.
- ``prefill``: new prompts read apart from the rows that already have KV.
- ``proposers``, ``lookup``: the draft model and prompt lookup fill each row's draft (the n-gram index).
- ``verifier``, ``sampling``: greedy verification and speculative sampling; per-row warping and random numbers.
- ``realign``: lazy unpad → append → repad as index arithmetic, and compaction.
- ``controller``: adaptive k, each row's draft length from its acceptance and the round-cost model.
- ``schedulers``: EqSpec's fixed batches, ExSpec's pool, and the one driver that loops them.
- ``core``: build_engine and the Engine, whose step is the decode loop.
- ``metrics``: GenerationStats and the stage timer.

Front doors (``batchspec.api``, ``batchspec.hf``, ``batchspec.ray``, the CLI, the server, the benchmarks) sit
outside this package and import its modules by name; nothing is re-exported here.
"""
