# The two device calls of 2026-11-26 (one NVIDIA H200, warm for the second); results as they came back.
# call 1 (550 s of work; peers at B = 8 and 32 cut by the deadline, see steps.txt):
PYTHONPATH=src bash scripts/gpu_session.sh 550
# call 2 (the peers cut from call 1), results in peers_b8_b32/:
PYTHONPATH=src RESULTS=/tmp/gpu_session2 bash -c 'mkdir -p $RESULTS; for s in 8 32; do timeout 110 python3 scripts/gpu_check.py throughput --cells peers --sizes $s --out $RESULTS/tp_peers_b$s > $RESULTS/peers_b$s.log 2>&1; done'
