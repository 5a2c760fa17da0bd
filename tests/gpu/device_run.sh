#!/usr/bin/env bash
# One device run: GPU tests, kernel trace recordings, overhead bench; results under $OUT.
# Usage on the lent machine (see docs/probe.md): bash tests/gpu/device_run.sh [wheels|libcupti|tests|tests_period|variants|traces|bench]...
#   wheels       install only cupti_python + pyelftools from .whl into /tmp/site (PyTorch's
#                nvidia-cuda-cupti stays the one libcupti); the cupti wheel only if cupti cannot load without it
#   libcupti     which libcupti files cupti-python and torch map (one copy wanted)
#   tests        tests/gpu with the probe's default settings
#   tests_period tests/gpu/test_probe_gpu.py with flush_mode=period, the ctypes (GIL-free) flush, bulk packing
#   profiler_exit the profiler scenario unprobed, probed without the hand-over, and with TEARDOWN_CUPTI=0
#   exit_reps    REPS runs of the profiler scenario per variant (EXIT_VARIANTS; default unprobed, probe, os._exit, no hook)
#   variants     one GPU test (TEST) under several probe environments (VARIANTS)
#   bench        bench/overhead.py (ROUNDS, CONFIGS, ALLOC, BENCH_TIMEOUT from the environment)
#   oom          tests/gpu/test_oom_gpu.py: a PyTorch and a CuPy process run to OOM under the daemon
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p "$R"; pack() { tar czf "$OUT/results.tgz" -C /tmp r; }
what=${*:-wheels libcupti tests traces bench}
maps='import sys
def maps(): return sorted({l.split(None,5)[5].strip() for l in open("/proc/self/maps") if "libcupti" in l and len(l.split(None,5))==6})
order = sys.argv[1]
if order == "torch_first":
    import torch; torch.zeros(1, device="cuda"); print("after torch:", maps())
from cupti import cupti
print("cupti timestamp", cupti.get_timestamp())
print("after cupti:", maps())
if order == "cupti_first":
    import torch; torch.zeros(1, device="cuda"); print("after torch:", maps())
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]): torch.ones(4, device="cuda").sum()
    print("after profiler:", maps())'
for w in $what; do case $w in
wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade -c constraints.txt --target /tmp/site \
    .whl/cupti_python-*.whl .whl/pyelftools-*.whl
  if ! PYTHONPATH=/tmp/site python3 -c 'from cupti import cupti; cupti.get_timestamp()' > "$R/wheels.txt" 2>&1; then
    echo "cupti-python cannot load without its own libcupti; installing nvidia-cuda-cupti too" | tee -a "$R/wheels.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade -c constraints.txt --target /tmp/site .whl/nvidia_cuda_cupti-*.whl
  fi
  ls /tmp/site >> "$R/wheels.txt" ;;
libcupti)
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -V;
    python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
    python3 -m pip list 2>/dev/null | grep -i -E 'cupti|cuda-bindings|nvidia-ml|pytest'; nproc
    for o in cupti_first torch_first; do echo "== $o"; timeout 60 python3 -c "$maps" $o 2>&1 | tail -6; done
  } > "$R/machine.txt" 2>&1; cat "$R/machine.txt" ;;
tests)
  OUT=$R GPUFOOTPRINT_GPU_OUT=$R timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu -rA 2>&1 | tee "$R/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" ;;
oom)
  GPUFOOTPRINT_GPU_OUT=$R timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_oom_gpu.py -rA 2>&1 | tee "$R/gpu_oom.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" ;;
tests_period)
  GPUFOOTPRINT_PROBE_FLUSH_MODE=period GPUFOOTPRINT_PROBE_BULK_PACK=1 GPUFOOTPRINT_PROBE_FLUSH_NOGIL=1 \
  GPUFOOTPRINT_PROBE_CUPTI_BUFFER_BYTES=65536 GPUFOOTPRINT_GPU_TAG=_period GPUFOOTPRINT_GPU_OUT=$R \
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_probe_gpu.py -rA 2>&1 | tee "$R/gpu_tests_period.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" ;;
profiler_exit)
  # Which part makes the profiler scenario die at exit ("double free or corruption")?
  for v in "unprobed WORKLOAD_NO_PROBE=1" "probe_no_hook GPUFOOTPRINT_PROBE_TORCH_HOOK=0"; do
    set -- $v
    env $2 GPUFOOTPRINT_PROBE_SOCKET= timeout 60 python3 tests/gpu/workload.py profiler > "$R/profiler_exit_$1.log" 2>&1
    echo "$1 ($2): rc=$?" | tee -a "$R/profiler_exit.txt"; tail -2 "$R/profiler_exit_$1.log" | cut -c1-300
  done
  for v in "teardown0 TEARDOWN_CUPTI=0"; do
    set -- $v
    env $2 GPUFOOTPRINT_GPU_TAG=_$1 GPUFOOTPRINT_GPU_OUT=$R timeout 90 python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_probe_gpu.py -k profiler > "$R/profiler_exit_$1.log" 2>&1
    echo "$1 ($2): pytest rc=$?" | tee -a "$R/profiler_exit.txt"; grep -E "double|passed|failed|Error" "$R/profiler_exit_$1.log" | head -4
  done ;;
exit_reps)
  # The exit crash after a torch.profiler session: REPS runs of each variant, 8 at a time,
  # no daemon (records dropped and counted), Python's fault handler on. rc 134 = abort.
  one() { # variant rep env...
    local v=$1 r=$2; shift 2
    env PYTHONFAULTHANDLER=1 GPUFOOTPRINT_PROBE_SOCKET= "$@" timeout 60 python3 tests/gpu/workload.py profiler \
      > "$R/exit_${v}_$r.log" 2>&1
    echo "$v $r rc=$?" >> "$R/exit_reps.txt"
  }
  export -f one; export R
  variants=${EXIT_VARIANTS:-"unprobed:WORKLOAD_NO_PROBE=1 probe:GPUFOOTPRINT_PROBE_X=1 osexit:WORKLOAD_OS_EXIT=1 nohook:GPUFOOTPRINT_PROBE_TORCH_HOOK=0"}
  # rc 127: a variant whose command line was wrong (not a result)
  for r in $(seq 1 ${REPS:-10}); do
    for v in $variants; do echo "${v%%:*} $r ${v#*:}" | tr '+' ' '; done  # NAME:VAR=x+VAR2=y,z
  done | xargs -P 8 -L 1 bash -c 'one "$@"' _
  sort "$R/exit_reps.txt" | awk '{split($3,a,"="); n[$1]++; if (a[2]!=0) bad[$1]++} END {for (v in n) printf "%-9s %d/%d failed\n", v, bad[v]+0, n[v]}'
  grep -l -E "double free|invalid pointer|corrupt|Fatal Python" "$R"/exit_*.log | head -3 | while read f; do
    echo "== $f"; grep -v UserWarning "$f" | grep -v _warn_once | tail -25 | cut -c1-240; done
  if command -v gdb > /dev/null; then
    for r in 1 2 3 4 5 6; do
      ( env GPUFOOTPRINT_PROBE_SOCKET= timeout 120 gdb -q -batch -ex run -ex bt -ex "info threads" \
          -ex "thread apply all bt 12" --args python3 tests/gpu/workload.py profiler > "$R/exit_gdb_$r.log" 2>&1 ) &
    done; wait
    grep -l -E "SIGABRT|SIGSEGV" "$R"/exit_gdb_*.log | head -1 | xargs -r sed -n '/signal SIG/,$p' | head -80 | cut -c1-240
  else echo "no gdb on this machine"; fi ;;
traces)
  for s in train graph; do
    GPUFOOTPRINT_PROBE_KERNELS=1 timeout 90 python3 -m gpufootprint record -o "$R/h200_kernels_$s.gfp.gz" -- \
      python3 tests/gpu/workload.py kernels_$s 2>&1 | tail -3
    timeout 30 python3 -m gpufootprint replay "$R/h200_kernels_$s.gfp.gz" --report-json "$R/replay_kernels_$s.json" 2>&1 | tail -2
  done ;;
variants)
  # One GPU test (TEST, a -k expression) under several probe environments (VARIANTS: NAME:VAR=x+VAR2=y ...);
  # each run's trace is kept as h200_probe_<scenario>_<NAME>.gfp.gz.
  for v in ${VARIANTS:-base:GPUFOOTPRINT_PROBE_X=1}; do
    env $(echo "${v#*:}" | tr '+' ' ') GPUFOOTPRINT_GPU_TAG=_${v%%:*} GPUFOOTPRINT_GPU_OUT=$R \
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_probe_gpu.py -k "${TEST:-expandable}" \
      > "$R/variant_${v%%:*}.log" 2>&1
    echo "${v%%:*} (${v#*:}): pytest rc=$?" | tee -a "$R/variants.txt"; grep -E "^E .*(Assertion|assert)" "$R/variant_${v%%:*}.log" | head -2 | cut -c1-300
  done ;;
bench)
  timeout ${BENCH_TIMEOUT:-300} python3 bench/overhead.py --rounds ${ROUNDS:-12} ${CONFIGS:+--configs $CONFIGS} \
    --alloc ${ALLOC:-caching} --progress --out "$R/overhead_${ALLOC:-caching}.json" 2> "$R/bench_${ALLOC:-caching}.err" \
    | tee "$R/bench_${ALLOC:-caching}.txt"
  tail -3 "$R/bench_${ALLOC:-caching}.err" ;;
esac; pack; done
ls -la "$OUT"
