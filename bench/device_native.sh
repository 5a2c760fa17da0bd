#!/usr/bin/env bash
# The C buffer callbacks on the lent GPU machine, in one call: the wheel in dist/ installed with its extras from
# .whl (carry dist and .whl), the GPU tests that read the probe's delivery, PyTorch's figures, failed allocations
# and OOMs, the callbacks' own cost (bench/callback_cost.py) and the live daemon's cost (bench/load.py).
# Everything it writes goes to $OUT/native.tgz.
#   bash bench/device_native.sh [TESTS_TIMEOUT]   (env: TESTS=..., CALLBACK=0 and LOAD=0 skip
#   either bench; the load bench runs after the tests even when the callback bench is skipped)
set -uo pipefail
O=${OUT:?}; R=/tmp/native; mkdir -p "$R"; T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
pack() { tar czf "$O/native.tgz" -C /tmp native; }
trap pack EXIT
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; python3 -V
  echo "commit $(cat dist/COMMIT 2>/dev/null) wheel $(sha256sum dist/*.whl | cut -c1-16)"
  python3 -m pip install -q --no-build-isolation --no-index --find-links .whl "$(ls dist/gpufootprint-*.whl | head -1)[probe,daemon]" 2>&1 | tail -3
  python3 -m pip list 2>/dev/null | grep -i -E "gpufootprint|cupti|^torch |cuda-bindings"
  # the GPU tests import the source tree (tests/conftest.py): the wheel's library goes beside its sources
  python3 -c "import zipfile,glob; z=zipfile.ZipFile(glob.glob('dist/*.whl')[0]); n='gpufootprint/probe/native/libgfp-cuptibuf.so'; open('daemon/'+n,'wb').write(z.read(n))"
  (cd /tmp && python3 -c "from gpufootprint.probe import nativecallbacks as n; print('installed library:', n.load()[1] or n.LIBRARY)")
  PYTHONPATH=daemon python3 -c "from gpufootprint.probe import nativecallbacks as n; print('source-tree library:', n.load()[1] or n.LIBRARY)"
  echo "installed at $(( $(date +%s) - T0 )) s"; } > "$R/machine.txt" 2>&1
cat "$R/machine.txt"
# TESTS (env): which GPU test files (default: the probe's delivery, PyTorch's figures, failed allocations)
GPUFOOTPRINT_GPU_OUT=$R timeout "${1:-330}" python3 -m pytest -q -p no:cacheprovider -rA -m gpu \
  ${TESTS:-tests/gpu/test_probe_gpu.py tests/gpu/test_torch_figures_gpu.py tests/gpu/test_live_failure_gpu.py} \
  > "$R/gpu_tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$R/gpu_tests.log" | tail -30
if [ "${CALLBACK:-1}" = 0 ]; then echo "no callback cost run (CALLBACK=0)"; else
for busy in 0 1; do
  c=$([ $busy = 0 ] && echo 20000 || echo 300)
  timeout 120 python3 bench/callback_cost.py --cycles $c --reps 5 --busy $busy --json "$R/callback_cost_busy$busy.json" > "$R/callback_cost_busy$busy.txt" 2>&1
  cat "$R/callback_cost_busy$busy.txt"
done
echo "callback cost done at $(( $(date +%s) - T0 )) s"; fi
[ "${LOAD:-1}" = 0 ] && { echo "no load run (LOAD=0)"; exit 0; }
timeout 150 python3 bench/load.py --rates 500000,2000000 --seconds 8 --frames cupti --json "$R/load.json" > "$R/load.txt" 2>&1
tail -25 "$R/load.txt"; echo "all done at $(( $(date +%s) - T0 )) s"
