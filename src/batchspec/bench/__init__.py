"""Benchmarks and equivalence audits: every method, including transformers' own, on one workload.

* :mod:`workload`: the models, prompts and budget;
* :mod:`runners`: how each method (batchspec's and the peers') turns a workload into sequences;
* :mod:`reference`: the target alone at batch size 1, its logit margins, exact/partial match;
* :mod:`sweep` (``batchspec bench``) with :mod:`cells`, :mod:`report` and :mod:`plots`;
* :mod:`merge` (``batchspec bench-merge``): runs of one workload made in pieces, as one sweep;
* :mod:`audit` (``batchspec audit``).
"""

from batchspec.bench.audit import AuditReport, run_audit
from batchspec.bench.runners import METHODS
from batchspec.bench.sweep import SweepPlan, SweepResult, run_sweep
from batchspec.bench.workload import Workload

__all__ = ["METHODS", "AuditReport", "SweepPlan", "SweepResult", "Workload", "run_audit", "run_sweep"]
