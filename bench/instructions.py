"""Instructions a bench's measured part executes, under valgrind's callgrind: a count that the neighbours of a
shared machine do not move, side by side with a base tree.

A 2-core VM shared with other work spreads timed runs by a third (an A/A pair of ``bench/cupti_runs.py`` read
0.68-1.48 on 2026-12-07), so a change of a few per cent cannot be resolved in time there. The instructions a
run executes are the same from run to run (``PYTHONHASHSEED`` fixed, one BLAS thread, byte code compiled
before): an A/A pair differs by a few instructions. Instructions are not time (a copy of many bytes is few
instructions, a cache miss costs none), so a count says what a change removed, and timed runs on a quiet host
say what that is worth.

The command is run with ``{n}`` as 1 and as 2 (rounds, replays): the difference is one round, without the
imports and the inputs' building that both runs share. ``{src}`` is ``--base`` or ``--new`` as given (a
daemon/ folder for ``bench/cupti_runs.py --src``, a tree for ``bench/replay_stages.py``).

  python bench/instructions.py --base /tmp/base/daemon --new daemon -- \
      bench/cupti_runs.py --src {src} --rounds {n} --flushes 100 --reads flush
  python bench/instructions.py --base /tmp/base --new . -- bench/replay_stages.py {src} FILE {n}

Prints, for base and new, the instructions of one round, their ratio, and the A/A difference (the base's
first run repeated).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path


def instructions(command: list[str], src: str, n: int) -> int:
    argv = [a.replace("{src}", src).replace("{n}", str(n)) for a in command]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *argv],
                         capture_output=True, text=True, env=env, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no count from callgrind:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the base tree (or its daemon/ folder): {src}")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[1] / "daemon"), help="this tree: {src}")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS with {src} and {n}")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command")
    for src in (args.base, args.new):  # byte code compiled first: a first run would count the compiler too
        warm = (f"import sys; sys.path[:0] = [{src!r}, {src + '/daemon'!r}]; "
                "import gpufootprint.ingest.protocol, gpufootprint.hub, gpufootprint.replay")
        subprocess.run([sys.executable, "-c", warm], check=True)
    b1, n1 = instructions(command, args.base, 1), instructions(command, args.new, 1)
    b2, n2 = instructions(command, args.base, 2), instructions(command, args.new, 2)
    again = instructions(command, args.base, 1)
    base, new = b2 - b1, n2 - n1
    print(f"base {args.base}: n=1 {b1:,}, n=2 {b2:,}, n=1 again {again:,}; new {args.new}: n=1 {n1:,}, n=2 {n2:,}")
    print(f"one round: base {base / 1e6:.1f} M instructions, new {new / 1e6:.1f} M, new/base {new / base:.3f}; "
          f"A/A {abs(again - b1):,} instructions ({abs(again - b1) / base * 100:.3f} % of a round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
