"""Peak transient memory and time of the sampler on [8, 5, 151936] logits (seeded rows with top_p, as the load test)."""
import resource, time, sys, torch
from batchspec.config import SamplingParams
from batchspec.engine.sampling import RowParams, warp_rows
from batchspec.engine.logprobs import scored
torch.manual_seed(0)
logits = torch.randn(8, 5, 151936) * 4
params = RowParams.of([SamplingParams(temperature=0.8, top_p=0.95)] * 8)
tokens = torch.randint(0, 151936, (8, 5))
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss(); peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter(); p = warp_rows(logits, params); tw = time.perf_counter() - t
peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
del p
t = time.perf_counter(); s = scored(logits, tokens, 5); ts = time.perf_counter() - t
peak2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ts2 = min(timeit for timeit in [(lambda: (lambda t0: (warp_rows(logits, params), time.perf_counter()-t0)[1])(time.perf_counter()))() for _ in range(3)])
print(f"warp peak +{(peak1-max(base,peak0))/1e6:.0f} MB {tw*1e3:.0f} ms (best of 3 {ts2*1e3:.0f} ms); scored peak +{(peak2-max(base,peak0))/1e6:.0f} MB {ts*1e3:.0f} ms; one [8,5,V] f64 = {8*5*151936*8/1e6:.0f} MB")
