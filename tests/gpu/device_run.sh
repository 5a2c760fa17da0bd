#!/usr/bin/env bash
# One device run: GPU tests, kernel trace recordings, overhead bench; results under $OUT.
# Usage on the lent machine (see docs/probe.md): bash tests/gpu/device_run.sh [tests|traces|bench]...
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p "$R"; pack() { tar czf "$OUT/results.tgz" -C /tmp r; }
what=${*:-tests traces bench}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -V;
  python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E 'cupti|cuda-bindings|nvidia-ml|pytest'; nproc; } > "$R/machine.txt" 2>&1
for w in $what; do case $w in
tests)
  GPUFOOTPRINT_GPU_OUT=$R timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -rA 2>&1 | tee "$R/gpu_tests.log" | tail -40 ;;
traces)
  for s in train graph; do
    GPUFOOTPRINT_PROBE_KERNELS=1 timeout 90 python3 -m gpufootprint record -o "$R/h200_kernels_$s.gfp.gz" -- \
      python3 tests/gpu/workload.py kernels_$s 2>&1 | tail -3
    timeout 30 python3 -m gpufootprint replay "$R/h200_kernels_$s.gfp.gz" --report-json "$R/replay_kernels_$s.json" 2>&1 | tail -2
  done ;;
bench)
  timeout ${BENCH_TIMEOUT:-300} python3 bench/overhead.py --rounds ${ROUNDS:-12} --out "$R/overhead.json" 2>&1 | tail -80 ;;
esac; pack; done
ls -la "$OUT"
