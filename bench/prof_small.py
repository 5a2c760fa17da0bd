import sys, cProfile, pstats, time
sys.path.insert(0, sys.argv[1] + "/daemon")
sys.path.insert(0, "/work/main")
from bench.replay_throughput import write_looped, write_native
from pathlib import Path
from gpufootprint.config import FootprintConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from gpufootprint.hub import FeatureHub
case = sys.argv[2]
p = Path(f"/tmp/prof/{case}.gfp")
if not p.exists():
    if case == "churn":
        write_native(p, 1_000_000)
    else:
        write_looped(Path("/work/main/tests/data") / f"{case}.gfp.gz", p, 200_000)
pipe = Pipeline(FootprintConfig(), hub=FeatureHub())
pr = cProfile.Profile()
t=time.process_time(); pr.enable(); r = replay_file(str(p), pipe); pr.disable(); t=time.process_time()-t
print(f"{r.records} records, {t:.2f} cpu-s under profile")
st = pstats.Stats(pr); st.sort_stats(sys.argv[3] if len(sys.argv)>3 else "tottime").print_stats(30)
