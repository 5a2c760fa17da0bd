#!/bin/bash
# What ran on the lent H200 on 2026-12-04 (docs/performance.md, run 22): .diag/ held this file and a
# static py-spy 0.4.3 (carried beside .whl and dist). Run 22: `bash .diag/run.sh` as is (the caching
# verdict). The async try: `sed -e "s/--alloc caching/--alloc async/" -e "s/verdict-caching/verdict-async/g"
# -e "s/ 150 360 540 || phase.*$/ 90 285 340/" .diag/run.sh > /tmp/a.sh; bash /tmp/a.sh`.
# verdict run with a start-up watchdog: py-spy stacks if round 0 has not begun in $WATCH s
O=$OUT; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export GPUFOOTPRINT_COMMIT=5d88ed9 PYTHONFAULTHANDLER=1
{ date -u +%FT%TZ; python3 -m pip install -q --no-build-isolation --no-index --find-links .whl 'dist/gpufootprint-0.1.0-py3-none-any.whl[probe,daemon]' 2>&1 || exit 1
  nvidia-smi -L; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_mode --format=csv; nproc
  python3 -m pip list 2>/dev/null | grep -i -E "cupti|^torch |numpy|cuda-bindings|nvidia-ml"; python3 -V; echo "installed at $(el) s"; } > $O/machine.txt 2>&1 || { cat $O/machine.txt; exit 1; }
phase() { # name watch maxsec timeout extra...
  local n=$1 w=$2 ms=$3 to=$4; shift 4
  echo "== $n start at $(el) s: $*" >> $O/diag.txt
  timeout $to python3 bench/overhead.py --configs verdict --rounds 60 --steps-a 12 --steps-b 80 --alloc caching \
    --max-seconds $ms --progress --out $O/$n.json "$@" > $O/$n.txt 2> $O/$n.err &
  local tp=$! s=$(date +%s)
  while kill -0 $tp 2>/dev/null; do
    grep -q "^round 0" $O/$n.err && { echo "$n: round 0 at $(el) s" >> $O/diag.txt; wait $tp; echo "$n: rc=$? at $(el) s" >> $O/diag.txt; return 0; }
    if [ $(( $(date +%s) - s )) -ge $w ]; then
      echo "$n: no round 0 after $w s; stacks at $(el) s" >> $O/diag.txt
      ps -eo pid,ppid,stat,pcpu,rss,wchan:28,etime,args --sort=pid | grep -v "ps -eo" >> $O/diag.txt
      nvidia-smi >> $O/diag.txt 2>&1
      pp=$(pgrep -P $tp); ws=$(pgrep -P $pp | sort -n); echo "workers: $ws" >> $O/diag.txt
      for p in $pp $(echo "$ws" | sed -n '1p;5p;9p;13p'); do echo "--- pid $p" >> $O/diag.txt; timeout 8 .diag/py-spy dump --pid $p >> $O/diag.txt 2>&1; done
      for p in $(echo "$ws" | sed -n '1p;9p;13p'); do echo "--- threads $p" >> $O/diag.txt; ps -L -o tid,stat,pcpu,wchan:28,comm -p $p >> $O/diag.txt; done
      for p in $(echo "$ws" | sed -n '9p;13p'); do echo "--- native pid $p" >> $O/diag.txt; timeout 15 .diag/py-spy dump --native --pid $p >> $O/diag.txt 2>&1; done
      kill $pp; sleep 3; for p in $(pgrep -P $pp); do kill -9 $p; done; kill -9 $pp 2>/dev/null; wait $tp
      echo "$n: killed at $(el) s" >> $O/diag.txt; return 1
    fi
    sleep 2
  done
  echo "$n: exited before round 0, at $(el) s" >> $O/diag.txt; return 1
}
phase verdict-caching 150 360 540 || phase verdict-caching-pin0 120 $(( 500 - $(el) )) $(( 560 - $(el) )) --pin 0
echo "done at $(el) s" >> $O/diag.txt
