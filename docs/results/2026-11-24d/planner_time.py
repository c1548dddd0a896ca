"""Host milliseconds of one ``AdaptiveLength.lengths`` call at B = 8, max k 10, a hybrid reach (both variants priced),
after 20 observed rounds. Prints one JSON line. Run from a checkout of any commit since 2026-11-24:

    PYTHONPATH=src python docs/results/2026-11-24d/planner_time.py
"""

import json
import time

from batchspec.engine.controller import AdaptiveLength, Reach, RoundRecord
from batchspec.engine.state import Sequence

rows = [Sequence(i, [1] * 50, 200) for i in range(8)]
planner = AdaptiveLength(10, 0.1)
flag = "uses_draft_model" if "uses_draft_model" in Reach.__dataclass_fields__ else "model"  # the older name
reach = Reach(lookups=[3, 0, 5, 2, 0, 1, 4, 0], first=[1] * 8, lag=[0] * 8, **{flag: True})
looked = "looked_up" if "looked_up" in RoundRecord.__dataclass_fields__ else "looked"  # the older name
for _ in range(20):
    lengths = planner.lengths(rows, reach, False)
    k = max(lengths)
    record = {"lengths": lengths, "accepted": [min(1, n) for n in lengths], "shadow": [None] * 8, "k": k,
              "forwards": k, "seconds": 0.05 + 0.01 * k, "draft_seconds": 0.002 * k, looked: [[False] * 11] * 8}
    planner.observe(rows, RoundRecord(**record))
calls = 200
started = time.perf_counter()
for _ in range(calls):
    planner.lengths(rows, reach, False)
milliseconds = (time.perf_counter() - started) / calls * 1000
print(json.dumps({"lengths_ms_per_call": round(milliseconds, 3), "rows": 8, "max_k": 10}))
