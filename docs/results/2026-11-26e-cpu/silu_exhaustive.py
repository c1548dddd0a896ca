"""Issue 35: batchspec's C SiLU (``native.silu``: torch's AVX-512 vector SiLU, SLEEF's expf) against torch's own
``F.silu`` on every float32 bit pattern but NaN, in calls of 2**26 values (whole vector steps: no scalar tail).
Prints the number of values whose bits differ (about a minute on 2 cores):

    PYTHONPATH=src python docs/results/2026-11-26e-cpu/silu_exhaustive.py
"""
import torch

from batchspec.int8 import native

torch.set_num_threads(2)
step, differ, compared = 2**26, 0, 0
for start in range(-(2**31), 2**31, step):
    x = torch.arange(start, start + step, dtype=torch.int64).to(torch.int32).view(torch.float32)
    number = ~x.isnan()
    differ += int(((native.silu(x).view(torch.int32) != torch.nn.functional.silu(x).view(torch.int32)) & number).sum())
    compared += int(number.sum())
print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}: {differ} of {compared} float32 values "
      f"differ")
