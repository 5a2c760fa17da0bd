"""``--src``, shared by the benches that time one revision's package against another's, side by side.

Imports nothing of gpufootprint (``_harness`` puts this tree's daemon first on the path): the bench imports it
after ``src_args``, from the tree ``--src`` names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def src_args(doc: str | None) -> argparse.Namespace:
    """The bench's arguments (``--src DAEMON_DIR``, default this tree's ``daemon/``), that folder first on the
    import path."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "daemon"),
                    help="the daemon/ folder of the revision to measure (a git worktree of a base)")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    return args
