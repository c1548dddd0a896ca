"""The decoding core: one round of batch speculative decoding, module by module in the order a round uses them.

- ``state``, ``kv_cache``: the batch's layout (Sequence, BatchState) and its KV caches (BatchKVCache, Slab).
- ``runner``, ``graphs``: every forward, staging of the round's host numbers and its one device→host read;
  CUDA graphs of the decode forwards.
- ``prefill``: new prompts read apart from the rows that already have KV.
- ``proposers``, ``lookup``: the draft model and prompt lookup fill each row's draft (the n-gram index).
- ``retokenize``: a draft of another tokenizer's text in its own tokens (TextBridge, bridged, bridge_of).
- ``verifier``, ``sampling``: greedy verification and speculative sampling; per-row warping and random numbers.
- ``exactmath``: the exp, log and fixed-order sums under the probabilities and the logprobs, the same bits on
  every CPU instruction set and thread count.
- ``shaping``, ``penalties``: a row's penalties, logit bias and grammar applied to the target's logits; the
  penalties record itself.
- ``realign``: lazy unpad → append → repad as index arithmetic, and compaction.
- ``draft_length``: the draft-length policy: a fixed k, or adaptive k, each row's draft length from its acceptance
  (``acceptance``, the counts each row keeps) and the round-cost model.
- ``schedulers``: EqSpec's refilled batch, ExSpec's pool, and the one driver that loops them.
- ``core``: build_engine and the Engine, whose step is the decode loop.
- ``request``: the request record (GenerationParams) that the front doors hand the engine, and its rows.
- ``metrics``: GenerationStats and the stage timer.
- ``errors``: InvariantError, what a broken invariant raises (never an ``assert``, which ``python -O`` strips).

Front doors (``batchspec.api``, ``batchspec.hf``, ``batchspec.ray``, the CLI, the server, the benchmarks) sit
outside this package and import what they use from here, its face, never its modules by name (tests/test_imports.py
checks): the modules can then move and split inside without a change outside.
"""

from batchspec.engine.core import Engine, build_engine, resolve_special_ids, runner_graphs
from batchspec.engine.errors import InvariantError
from batchspec.engine.grammar import Grammar, GrammarCompiler, GrammarError
from batchspec.engine.graphs import GraphMode
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.logprobs import MAX_TOP, TokenLogprob
from batchspec.engine.metrics import STAGES, GenerationStats
from batchspec.engine.penalties import MAX_BIAS, Penalties
from batchspec.engine.request import GenerationParams
from batchspec.engine.retokenize import TextBridge, bridge_of, bridged
from batchspec.engine.runner import ModelRunner
from batchspec.engine.sampling import derive_row_seeds
from batchspec.engine.schedulers import Scheduler, make_scheduler
from batchspec.engine.schedulers.drive import Offline, drive
from batchspec.engine.state import FINISH_LENGTH, BatchState, Sequence, check_budget

__all__ = [
    "FINISH_LENGTH", "MAX_BIAS", "MAX_TOP", "STAGES", "BatchKVCache", "BatchState", "Engine", "GenerationParams",
    "GenerationStats", "Grammar", "GrammarCompiler", "GrammarError", "GraphMode", "InvariantError", "ModelRunner",
    "Offline", "Penalties", "Scheduler", "Sequence", "TextBridge", "TokenLogprob", "bridge_of", "bridged",
    "build_engine", "check_budget", "derive_row_seeds", "drive", "make_scheduler", "resolve_special_ids",
    "runner_graphs",
]
