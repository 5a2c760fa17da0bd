#!/usr/bin/env bash
# The CUDA Graph advice GPU test (tests/gpu/test_graph_advice_gpu.py) on the lent machine, as a user installs
# the wheel (carry dist and .whl); what it records comes back as $OUT/graph.tgz, its log as $OUT/graph_tests.log.
#   bash bench/device_graph.sh [pytest -k expression]
set -uo pipefail
O=${OUT:?OUT is the folder whose files come back}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-index --find-links .whl "$(ls dist/gpufootprint-*.whl | head -1)[probe,daemon]" \
  > "$O/graph_pip.txt" 2>&1 || { cat "$O/graph_pip.txt"; exit 1; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv; nproc; } > "$O/graph_machine.txt" 2>&1
mkdir -p /tmp/g/graph
GPUFOOTPRINT_GRAPH_AFTER_S=${GRAPH_AFTER_S:-8} GPUFOOTPRINT_GPU_OUT=/tmp/g/graph timeout "${GRAPH_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu/test_graph_advice_gpu.py -rA ${1:+-k "$1"} > "$O/graph_tests.log" 2>&1
echo "pytest rc=$?" >> "$O/graph_tests.log"
tar czf "$O/graph.tgz" -C /tmp/g graph
grep -E "passed|failed|PASSED|FAILED|rc=" "$O/graph_tests.log" | tail -12
