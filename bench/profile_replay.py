"""Where a replay spends its time: cProfile of replay_file on FILE, importing gpufootprint from SRC (a tree or a
worktree of a base revision), the six functions with the most own time, as shares of the replay.

Usage: python bench/profile_replay.py SRC FILE
"""

import sys, cProfile, pstats, io
sys.path.insert(0, sys.argv[1] + "/daemon")
from gpufootprint.config import FootprintConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
p = Pipeline(FootprintConfig())
pr = cProfile.Profile(); pr.enable(); replay_file(sys.argv[2], p); pr.disable()
st = pstats.Stats(pr); total = st.total_tt
rows = sorted(((v[2], f) for f, v in st.stats.items()), reverse=True)[:6]
print(f"total {total:.2f} s")
for tt, f in rows: print(f"  {100*tt/total:5.1f} %  {f[2]} ({f[0].split('gpufootprint/')[-1]}:{f[1]})")
