"""Launch windows: the CUDA Graph advisor's evidence from the host side, at no lasting cost.

A window of CUPTI's kernel activity (KERNEL or CONCURRENT_KERNEL) left a loop of tiny launches
about 10 % slower for the rest of the process on the H200 (docs/performance.md, runs 17 and 18),
whichever kind it was. CUPTI's per-API switches for the launch and synchronisation calls left no
such slowdown in the same diagnostic (tests/gpu/cupti_modes_diag.py, ``runtime_launch``). So a
*launch window* switches on a ``CUpti_ActivityAPI`` record for each call below, driver and
runtime alike, and turns them into ``RecordKind.API`` records: when each launch and each wait
for the GPU began and ended, on which thread. The daemon's advisor reads the step (the launches
between two waits), how long the host spent launching and how long it waited
(``engines/launches.py``). The records carry no kernel name and no GPU time: what that leaves
unknown is said there.

Numbers are CUPTI's generated cbids (stable values of its headers); tests/unit/test_probe_launches.py
checks them against cupti-python's enums, as probe/oom.py's allocation tables are checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from gpufootprint.records import DTYPES, ApiRole, RecordKind, select
from gpufootprint.wire import cupti_layout

LAUNCH, SYNC, GRAPH = ApiRole.LAUNCH, ApiRole.SYNC, ApiRole.GRAPH_LAUNCH

#: CUpti_runtime_api_trace_cbid -> (name, role)
RUNTIME_CBIDS: Final[dict[int, tuple[str, ApiRole]]] = {
    211: ("cudaLaunchKernel_v7000", LAUNCH), 214: ("cudaLaunchKernel_ptsz_v7000", LAUNCH),
    430: ("cudaLaunchKernelExC_v11060", LAUNCH), 431: ("cudaLaunchKernelExC_ptsz_v11060", LAUNCH),
    269: ("cudaLaunchCooperativeKernel_v9000", LAUNCH), 270: ("cudaLaunchCooperativeKernel_ptsz_v9000", LAUNCH),
    311: ("cudaGraphLaunch_v10000", GRAPH), 312: ("cudaGraphLaunch_ptsz_v10000", GRAPH),
    165: ("cudaDeviceSynchronize_v3020", SYNC), 131: ("cudaStreamSynchronize_v3020", SYNC),
    239: ("cudaStreamSynchronize_ptsz_v7000", SYNC), 137: ("cudaEventSynchronize_v3020", SYNC),
    31: ("cudaMemcpy_v3020", SYNC),  # synchronous with the host
}

#: CUpti_driver_api_trace_cbid -> (name, role): what a program calls on the driver itself (Triton,
#: cuda-bindings, Numba); CUPTI writes no DRIVER record for the driver call inside a runtime call.
DRIVER_CBIDS: Final[dict[int, tuple[str, ApiRole]]] = {
    307: ("cuLaunchKernel", LAUNCH), 442: ("cuLaunchKernel_ptsz", LAUNCH),
    652: ("cuLaunchKernelEx", LAUNCH), 653: ("cuLaunchKernelEx_ptsz", LAUNCH),
    477: ("cuLaunchCooperativeKernel", LAUNCH), 478: ("cuLaunchCooperativeKernel_ptsz", LAUNCH),
    514: ("cuGraphLaunch", GRAPH), 515: ("cuGraphLaunch_ptsz", GRAPH),
    17: ("cuCtxSynchronize", SYNC), 800: ("cuCtxSynchronize_v2", SYNC), 126: ("cuStreamSynchronize", SYNC),
    440: ("cuStreamSynchronize_ptsz", SYNC), 121: ("cuEventSynchronize", SYNC),
    278: ("cuMemcpyDtoH_v2", SYNC), 398: ("cuMemcpyDtoH_v2_ptds", SYNC),
}

CBIDS: Final[dict[int, dict[int, tuple[str, ApiRole]]]] = {cupti_layout.DRIVER: DRIVER_CBIDS,
                                                           cupti_layout.RUNTIME: RUNTIME_CBIDS}

# Lookup tables by cbid: the role (0: not a launch-window call).
_ROLE_TABLES: Final[dict[int, np.ndarray]] = {}
for _kind, _table in CBIDS.items():
    _roles = np.zeros(max(_table) + 1, dtype=np.uint8)
    for _cbid, (_, _role) in _table.items():
        _roles[_cbid] = _role
    _ROLE_TABLES[_kind] = _roles

def roles_of(kind: int, cbids: np.ndarray) -> np.ndarray:
    """Each cbid's role in a launch window (0: none), in the numbering of ``kind`` (DRIVER or RUNTIME)."""
    table = _ROLE_TABLES.get(kind)
    out = np.zeros(len(cbids), dtype=np.uint8)
    if table is None:
        return out
    known = cbids < len(table)
    out[known] = table[cbids[known].astype(np.intp)]
    return out


def api_records(u8: np.ndarray, offsets: Sequence[int], kind: int, pid: int, dev: int) -> np.ndarray:
    """The launch-window calls among one raw buffer's API records of ``kind``, as ``RecordKind.API``."""
    if not len(offsets):
        return np.zeros(0, DTYPES[RecordKind.API])
    raw = cupti_layout.gather(u8, kind, offsets)
    roles = roles_of(kind, raw["cbid"])
    keep = roles != 0
    raw, roles = select(raw, keep), roles[keep]  # as words: numpy takes a struct's fields one by one
    out = np.zeros(len(raw), DTYPES[RecordKind.API])
    out["start"], out["end"], out["tid"], out["corr"], out["cbid"] = (raw["start"], raw["end"], raw["tid"],
                                                                        raw["corr"], raw["cbid"])
    out["pid"], out["dev"], out["domain"], out["role"] = pid, dev, kind, roles
    return out


def api_objects(records: list[Any], pid: int, dev: int) -> np.ndarray:
    """The same from cupti-python's ActivityAPI objects (the objects delivery path)."""
    rows = []
    for rec in records:
        kind = int(getattr(rec, "kind", -1))
        cbid = int(getattr(rec, "cbid", -1))
        entry = CBIDS.get(kind, {}).get(cbid)
        if entry is not None:
            rows.append((int(getattr(rec, "start", 0)), int(getattr(rec, "end", 0)), pid, dev,
                         int(getattr(rec, "thread_id", 0)), int(getattr(rec, "correlation_id", 0)), cbid, kind,
                         int(entry[1])))
    out = np.zeros(len(rows), DTYPES[RecordKind.API])
    for i, r in enumerate(rows):
        (out[i]["start"], out[i]["end"], out[i]["pid"], out[i]["dev"], out[i]["tid"], out[i]["corr"],
         out[i]["cbid"], out[i]["domain"], out[i]["role"]) = r
    return out
