export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
mkdir -p $OUT/tp_off8_fix
timeout 100 python3 scripts/gpu_check.py throughput --cells batchspec --sizes 8 --out $OUT/tp_off8_fix > $OUT/tp.log 2>&1; echo "tp rc=$?"
timeout 70 python3 -m pytest -p no:cacheprovider -q -rfEs tests/test_graphs.py tests/test_runner.py > $OUT/pytest6.txt 2>&1; echo "pytest rc=$?"
tail -2 $OUT/pytest6.txt; grep tokens/s $OUT/tp.log
