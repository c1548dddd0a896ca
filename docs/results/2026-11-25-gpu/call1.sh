#!/usr/bin/env bash
# GPU call 1: correctness, in parallel (no timings).
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
mkdir -p $OUT/r
{ nvidia-smi; python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"; lscpu | head -20; } > $OUT/machine.txt 2>&1
G="python3 scripts/gpu_check.py"
( timeout 480 python3 -m pytest -p no:cacheprovider -q -rfEs --durations=15 tests/test_graphs.py tests/test_runner.py tests/test_invariant.py > $OUT/pytest.txt 2>&1 ) &
( timeout 480 $G syncs --out $OUT/r/syncs > $OUT/r/syncs.log 2>&1 ) &
( timeout 480 $G invariance --tiny-dtype bfloat16 --out $OUT/r/inv_bf16 > $OUT/r/inv_bf16.log 2>&1 ) &
( timeout 480 $G invariance --tiny-dtype float32 --out $OUT/r/inv_f32 > $OUT/r/inv_f32.log 2>&1 ) &
( timeout 480 $G equivalence --out $OUT/r/eq_off > $OUT/r/eq_off.log 2>&1 ) &
( timeout 480 $G equivalence --cuda-graphs on --out $OUT/r/eq_on > $OUT/r/eq_on.log 2>&1 ) &
( timeout 480 $G equivalence --tiny-dtype bfloat16 --batch-invariant --out $OUT/r/eq_bf16_inv > $OUT/r/eq_bf16_inv.log 2>&1 ) &
( timeout 480 $G equivalence --tiny-dtype bfloat16 --batch-invariant --cuda-graphs on --out $OUT/r/eq_bf16_inv_on > $OUT/r/eq_bf16_inv_on.log 2>&1 ) &
wait
cd $OUT && tar czf results.tgz r && rm -rf r
tail -5 $OUT/pytest.txt
