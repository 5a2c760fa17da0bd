"""What a probe's identity costs against ``daemon.max_metadata_bytes``: its HELLO (as ``hostinfo.hello`` builds it
in this process) with N CUDA devices, charged as the daemon charges it (``metadata_charge``), once the META that
names the devices has been merged into it (no GPU needed: the devices are made up, each as CUDA names an H200).

  python bench/hello_size.py [N ...]   (default: 1 8 16 32)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.config import DaemonConfig  # noqa: E402
from gpufootprint.ingest.session import clean_info  # noqa: E402
from gpufootprint.ingest.validate import metadata_charge  # noqa: E402
from gpufootprint.probe import hostinfo  # noqa: E402

versions = {"cupti_python": "13.0.1", "cupti": 130001, "driver": 13000, "cupti_per_thread_buffer": True}
limit = DaemonConfig().max_metadata_bytes
print(f"daemon.max_metadata_bytes {limit}")
for n in [int(a) for a in sys.argv[1:]] or [1, 8, 16, 32]:
    devices = [{"index": i, "name": "NVIDIA H200", "pci_bus_id": f"0000:{0x18 + i:02X}:00.0",
                "total_bytes": 150_109_880_320} for i in range(n)]
    info = clean_info({**hostinfo.hello(4242, versions, [], False), "flush_mode": "period", "delivery": "raw",
                       "callbacks": "c", "copies": "off", "cupti_buffers": 3, "launch_windows": 1, "watermark_ms": 1000})
    merged = {**info, **clean_info({"devices": devices})}
    charge = metadata_charge(merged)
    print(f"{n:3d} devices: {charge:6d} bytes charged ({'within' if charge <= limit else 'past'} the limit)")
