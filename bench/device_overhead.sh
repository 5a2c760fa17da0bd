#!/usr/bin/env bash
# One overhead verdict on the lent GPU machine, with a start-up watchdog; everything it writes goes to $OUT.
#
#   bash bench/device_overhead.sh NAME ALLOC 'CONFIGS' ROUNDS MAX_SECONDS [more bench/overhead.py args]
#   e.g. bash bench/device_overhead.sh verdict-caching caching 'none*4,aa*4,probe*4,cupti_floor*4' 60 400
#
# .whl must hold every wheel of those extras the machine lacks: `../shared/tools/gpu-wheels.sh zlib-ng==1.1.0`
# (cupti-python, pyelftools, bcrypt by default; zlib-ng since the daemon extra names it, 2026-12-06).
# Installs the wheel in dist/ with the probe and daemon extras from .whl (carry dist and .whl), as a user
# would, then runs bench/overhead.py at 12 and 80 steps a round. If round 0 has not begun after WATCH
# seconds (default 150) it writes every process, nvidia-smi and py-spy stacks of each worker (py-spy from
# .whl when there) to $OUT/NAME.diag and stops the bench: a worker that never became ready (run 22's
# start-up hang) is then named, not guessed.
#
# PYSPY_SECONDS=N (env) also samples a probe and a floor worker with py-spy during the run (below).
# GPUFOOTPRINT_BENCH_THREAD_CPU=1 (env) has every worker report each thread's CPU time inside its timed steps.
#
# Time on an H100 host (2026-12-06, 4 workers a group, 14 workers): a round of 12/80 steps takes 4.9-5.1 s
# (caching, cudaMallocAsync), of 6/40 steps with caching off about 6.0 s, plus about 20 s to start and 20 s
# to end: 60 rounds need MAX_SECONDS of about 330 (caching, async) to 380 (caching off), so one verdict a
# call (600 s at most). Runs 44-46 were given 225-275 s and stopped at 43-49 rounds: not verdicts. On H100
# 91bc0c1c (2026-12-07, run 57) a round with caching off took 7.1 s: 370 s stopped it at 49 rounds, and 60
# need about 470 (a 16-worker caching run with none_discover, 6.1 s a round, 390 s in all).
# On the slower H200 f8be4986 (2026-12-07, runs 59-60) caching off took 7.5 s a round (60 in 463 s after a
# 25 s start) and cudaMallocAsync 6.3 s (330 s stopped it at 48): give cudaMallocAsync 420 there.
# On H100 8db1a075 (2026-12-07, runs 61-62, slower still) caching off with 14 workers took about 9 s a round
# (535 s stopped it at 56: 60 need about 580, so drop a group or give it the whole 600) and cudaMallocAsync
# with 12 workers 5.7 s (60 rounds in 371 s after a 30 s start).
# On H200 36476aa1 (2026-12-07, run 63) cudaMallocAsync with 14 workers took 8.5 s a round (470 s stopped it at 55,
# round 0 at 34 s): 60 rounds of 14 workers do not fit a call there; 12 workers, or 10, with about 480. Or two calls
# of 30 rounds on one warm machine, pooled: python bench/overhead.py --reanalyse A.json B.json (one GPU, one commit).
# The device's copy of the tree may carry a stale git HEAD: build the wheel with its commit beside it,
#   rm -rf dist && python -m build --wheel -o dist && git rev-parse --short HEAD > dist/COMMIT
# and the summary names that commit (GPUFOOTPRINT_COMMIT) and the machine file the wheel's sha256.
set -uo pipefail
name=$1 alloc=$2 configs=$3 rounds=$4 maxsec=$5; shift 5
O=${OUT:?OUT is the folder whose files come back}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
export GPUFOOTPRINT_COMMIT=${GPUFOOTPRINT_COMMIT:-$(cat dist/COMMIT 2>/dev/null)}
{ date -u +%FT%TZ
  python3 -m pip install -q --no-build-isolation --no-index --find-links .whl "$(ls dist/gpufootprint-*.whl | head -1)[probe,daemon]" 2>&1 || exit 1
  python3 -m pip install -q --no-index --find-links .whl py-spy 2>/dev/null || echo "no py-spy in .whl"
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_mode --format=csv; nproc
  echo "wheel $(sha256sum dist/gpufootprint-*.whl | head -1) commit ${GPUFOOTPRINT_COMMIT:-unknown}"
  python3 -m pip list 2>/dev/null | grep -i -E "gpufootprint|cupti|^torch |numpy|cuda-bindings|nvidia-ml"; python3 -V
  echo "installed at $(el) s"; } > "$O/$name.machine.txt" 2>&1 || { cat "$O/$name.machine.txt"; exit 1; }
watch=${WATCH:-150}
# PYSPY_SECONDS=N: once round ${PYSPY_ROUND:-5} has begun, py-spy samples the first worker of each of
# ${PYSPY_CONFIGS:-probe cupti_floor} for N seconds, without stopping it (--nonblocking), twice: the
# thread holding the GIL (--gil) and every thread (--idle); collapsed stacks in $O/NAME.pyspy-CONFIG-*.txt.
profile_workers() {
  until grep -q "^round ${PYSPY_ROUND:-5} " "$O/$name.err" || ! kill -0 $bench 2>/dev/null; do sleep 1; done
  for c in ${PYSPY_CONFIGS:-probe cupti_floor}; do
    pid=$(pgrep -f -- "overhead.py --worker $c --socket" | head -1)
    [ -n "$pid" ] || { echo "py-spy: no worker $c" >> "$O/$name.diag"; continue; }
    py-spy record -p "$pid" -d "$PYSPY_SECONDS" -r 200 -f raw --threads --gil --nonblocking \
      -o "$O/$name.pyspy-$c-gil.txt" >> "$O/$name.diag" 2>&1 &
    py-spy record -p "$pid" -d "$PYSPY_SECONDS" -r 200 -f raw --threads --idle --nonblocking \
      -o "$O/$name.pyspy-$c-all.txt" >> "$O/$name.diag" 2>&1 &
  done
}
python3 bench/overhead.py --configs "$configs" --rounds "$rounds" --steps-a 12 --steps-b 80 --alloc "$alloc" \
  --max-seconds "$maxsec" --progress --out "$O/$name.json" "$@" > "$O/$name.txt" 2> "$O/$name.err" &
bench=$!
started=$(date +%s)
while kill -0 $bench 2>/dev/null; do
  if grep -q "^round 0" "$O/$name.err"; then
    echo "round 0 at $(el) s" >> "$O/$name.diag"
    if [ "${PYSPY_SECONDS:-0}" -gt 0 ]; then profile_workers; fi
    wait $bench; echo "rc=$? at $(el) s" >> "$O/$name.diag"; break
  fi
  if [ $(( $(date +%s) - started )) -ge "$watch" ]; then
    { echo "no round 0 after $watch s; at $(el) s"
      ps -eo pid,ppid,stat,pcpu,rss,wchan:28,etime,args --sort=pid | grep -v "ps -eo"
      nvidia-smi
      for p in $(pgrep -P $bench); do echo "--- pid $p"; timeout 15 py-spy dump --native --pid "$p"; done
    } >> "$O/$name.diag" 2>&1
    pkill -P $bench; sleep 3; pkill -9 -P $bench; kill -9 $bench 2>/dev/null
    echo "killed at $(el) s" >> "$O/$name.diag"; break
  fi
  sleep 2
done
tail -40 "$O/$name.txt"; cat "$O/$name.diag"
