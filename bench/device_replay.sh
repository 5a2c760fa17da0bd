#!/usr/bin/env bash
# The daemon's replay throughput on the lent GPU machine's host CPUs (where a node's daemon runs), side by side
# with a baseline unpacked into .bench-base (carry it, with dist and .whl):
#   rm -rf .bench-base && mkdir .bench-base && git archive REV | tar -x -C .bench-base daemon && echo REV > .bench-base/COMMIT
#   bash bench/device_replay.sh [ROUNDS] [CASES] [MAX_SECONDS]
# Installs the wheel in dist/ with its extras from .whl (its dependencies: the bench's workers import each tree's
# daemon/ sources), names the CPU, and writes $OUT/replay.{txt,json} and $OUT/cpu.txt.
set -uo pipefail
O=${OUT:?OUT is the folder whose files come back}; T0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-index --find-links .whl "$(ls dist/gpufootprint-*.whl | head -1)[probe,daemon]" 2>&1 | tail -3
{ date -u +%FT%TZ; lscpu | grep -E "Model name|^CPU\(s\)|MHz"; python3 -V; echo "new: $(cat dist/COMMIT 2>/dev/null) tree; base: $(cat .bench-base/COMMIT)"; } > "$O/cpu.txt"
cat "$O/cpu.txt"
timeout "${3:-200}" python3 bench/replay_throughput.py --base-tree .bench-base --rounds "${1:-5}" \
  --cases "${2:-churn-4096,h200-async,cupti-jsonl}" --loop-records 200000 --json "$O/replay.json" > "$O/replay.txt" 2>&1
echo "replay rc=$? in $(( $(date +%s) - T0 )) s"; tail -6 "$O/replay.txt"
