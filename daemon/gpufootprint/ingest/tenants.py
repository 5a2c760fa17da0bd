"""Fair shares of the daemon's node-wide bounds: by tenant, and inside a tenant by process.

A GPU node is shared by teams, and any local process may open the probe socket. A bound that is
first come, first served lets one of them fill it and blind the daemon for everyone who comes
later. So every node-wide bound (connections, device tables, live allocations, records waiting
for a watermark or inside an open resync, retained kernels, kernel names) is held as a ``Room``:
what each tenant and each process uses of it, and a share each may use.

The tenant is the pod (or container) the process runs in, from /proc/PID/cgroup, because in
Kubernetes most containers run as the same uid; a process outside any container is its uid's
(SO_PEERCRED), which a local user cannot choose.

The policy, the same for every bound with total ``T`` (docs/reliability.md):

* a tenant may use at most ``T / tenants`` (the tenants with a live probe connection, itself
  included), and inside it one process at most the tenant's share over its connected processes;
* a tenant alone may use all of ``T``; when others arrive its share shrinks and it cannot grow
  until it is under it again (nothing it holds is taken away: that would make its footprint
  wrong). The others' room does not wait for it: all tenants together may hold up to ``2 T``
  (the ceiling the memory is sized for), so a tenant that filled the node while alone never
  makes a newcomer's records be dropped;
* at accept, when ``daemon.max_connections`` is reached, a newcomer under its share takes the
  place of the newest idle connection of the tenant (then the process) holding the most; only a
  newcomer whose tenant and process are at their shares is refused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpufootprint.k8s.cgroup import read_container

#: How far over its total a bound may go while tenants that filled it alone still hold their room.
CEILING = 2


def tenant_of(pid: int, uid: int, proc_root: str | Path = "/proc") -> str:
    """``pod/<uid>`` or ``container/<id>`` when the process runs in one, else ``uid/<uid>``."""
    ref = read_container(pid, proc_root)
    if ref is not None:
        return f"pod/{ref.pod_uid}" if ref.pod_uid else f"container/{ref.container_id[:12]}"
    return f"uid/{uid}"


def share(total: int, parties: int) -> int:
    """One party's share of ``total``: an equal part, at least 1 (a bound of 0 admits nothing)."""
    if total <= 0:
        return 0
    return max(1, total // max(1, parties))


@dataclass
class Census:
    """Who shares the bounds now: the tenants with a live probe connection and their processes."""

    tenant_of: dict[int, str] = field(default_factory=dict)  # pid -> tenant, kept while the pid is known
    uid_of: dict[int, int] = field(default_factory=dict)  # pid -> uid (for the metric by uid)
    processes: dict[str, set[int]] = field(default_factory=dict)  # tenant -> connected pids

    def connect(self, pid: int, uid: int, tenant: str) -> None:
        self.tenant_of[pid], self.uid_of[pid] = tenant, uid
        self.processes.setdefault(tenant, set()).add(pid)

    def disconnect(self, pid: int, still_connected: bool) -> None:
        tenant = self.tenant_of.get(pid)
        if tenant is None or still_connected:
            return
        pids = self.processes.get(tenant)
        if pids is not None:
            pids.discard(pid)
            if not pids:
                del self.processes[tenant]

    def forget(self, known: Iterable[int]) -> None:
        """Drop the pids neither connected nor held by the pipeline any more (bounded memory)."""
        keep = set(known)
        for pids in self.processes.values():
            keep |= pids
        for pid in [p for p in self.tenant_of if p not in keep]:
            del self.tenant_of[pid]
            self.uid_of.pop(pid, None)

    def tenant(self, pid: int) -> str:
        return self.tenant_of.get(pid, f"pid/{pid}")

    def shares(self, total: int, pid: int) -> tuple[int, int]:
        """(the tenant's share, the process's share inside it) of ``total`` for ``pid``."""
        tenant = self.tenant(pid)
        tenants = len(self.processes) + (tenant not in self.processes)
        mine = self.processes.get(tenant, set())
        t_share = share(total, tenants)
        return t_share, share(t_share, len(mine) + (pid not in mine))


class Room:
    """What each process and tenant holds of one node-wide bound, and how much more each may take."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.by_pid: Counter[int] = Counter()
        self.by_tenant: Counter[str] = Counter()
        self.used = 0

    def recount(self, usage: Mapping[int, int], census: Census) -> None:
        """Set from what the pipeline holds (each tick): what moved between ticks is exact again."""
        self.by_pid = Counter({pid: n for pid, n in usage.items() if n})
        self.by_tenant = Counter()
        for pid, n in self.by_pid.items():
            self.by_tenant[census.tenant(pid)] += n
        self.used = sum(self.by_pid.values())

    def add(self, pid: int, n: int, census: Census) -> None:
        """Take ``n`` (negative: give back)."""
        if n == 0:
            return
        self.by_pid[pid] = max(0, self.by_pid[pid] + n)
        tenant = census.tenant(pid)
        self.by_tenant[tenant] = max(0, self.by_tenant[tenant] + n)
        self.used = max(0, self.used + n)

    def room(self, pid: int, total: int, census: Census, per_process: int | None = None) -> int:
        """How much more ``pid`` may take: within its process share, its tenant's share, and the
        ceiling of all tenants together (``per_process``: a fixed bound of its own besides)."""
        t_share, p_share = census.shares(total, pid)
        if per_process is not None:
            p_share = min(p_share, per_process)
        tenant = census.tenant(pid)
        return max(0, min(p_share - self.by_pid[pid], t_share - self.by_tenant[tenant],
                          CEILING * total - self.used))

    def at_share(self, pid: int, total: int, census: Census, per_process: int | None = None) -> str:
        """Which bound a refusal hit, for the log: ``process``, ``tenant`` or ``node``."""
        t_share, p_share = census.shares(total, pid)
        if per_process is not None:
            p_share = min(p_share, per_process)
        if self.by_pid[pid] >= p_share:
            return "process"
        if self.by_tenant[census.tenant(pid)] >= t_share:
            return "tenant"
        return "node"


@dataclass(frozen=True)
class Holder:
    """One open probe connection, as the accept-time choice sees it."""

    key: int  # the connection's socket number
    pid: int
    tenant: str
    opened: float  # monotonic
    idle: bool  # it has sent no record yet


def make_room(holders: list[Holder], pid: int, tenant: str, limit: int) -> Holder | bool:
    """At ``daemon.max_connections``: which connection a newcomer (``pid``, ``tenant``) replaces, or
    False when the newcomer is refused (its tenant, and its process inside it, are at their shares);
    True when there is room without replacing any."""
    if len(holders) < limit:
        return True
    by_tenant = Counter(h.tenant for h in holders)
    t_share = share(limit, len(by_tenant) + (tenant not in by_tenant))
    if by_tenant[tenant] < t_share:
        # The tenant holding the most gives one up (never the newcomer's own: it is under its share).
        biggest = max((t for t in by_tenant if t != tenant), key=lambda t: by_tenant[t], default=None)
        if biggest is None:
            return False
        return _newest_idle([h for h in holders if h.tenant == biggest])
    mine = [h for h in holders if h.tenant == tenant]
    by_pid = Counter(h.pid for h in mine)
    p_share = share(t_share, len(by_pid) + (pid not in by_pid))
    if by_pid[pid] < p_share:
        biggest_pid = max((p for p in by_pid if p != pid), key=lambda p: by_pid[p], default=None)
        if biggest_pid is None or by_pid[biggest_pid] <= p_share:
            return False
        return _newest_idle([h for h in mine if h.pid == biggest_pid])
    return False


def _newest_idle(holders: list[Holder]) -> Holder:
    """Of one holder's connections, the newest that has sent no record, else the newest: a probe
    that reports is disturbed last."""
    return max(holders, key=lambda h: (h.idle, h.opened))


#: Distinct uids the refusal metric names; others are counted under uid="other" (label cardinality).
MAX_OFFENDER_UIDS = 32
#: One log line per offending tenant this often, with what it was refused since the last line.
OFFENDER_LOG_S = 60.0
#: Tenants remembered for that log at most (a churn of tenants forgets the quietest first).
_MAX_LOGGED = 256


class Offenders:
    """Who is at a bound: records and connections refused by (uid, reason), for the metric
    ``gpufootprint_daemon_share_refusals_total``, and one log line per tenant per minute."""

    def __init__(self, log: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.refused: Counter[tuple[str, str]] = Counter()  # (uid label, reason) -> count
        self._log = log or logging.getLogger("gpufootprint.ingest.server")
        self._clock = clock
        self._last: dict[str, tuple[float, Counter[str]]] = {}  # tenant -> (last line, refused since)

    def uid_label(self, uid: int) -> str:
        label = str(uid) if uid >= 0 else "unknown"
        if any(u == label for u, _ in self.refused) or len({u for u, _ in self.refused}) < MAX_OFFENDER_UIDS:
            return label
        return "other"

    def note(self, uid: int, tenant: str, pid: int, reason: str, n: int, level: str) -> None:
        if n <= 0:
            return
        self.refused[(self.uid_label(uid), reason)] += n
        now = self._clock()
        last, since = self._last.get(tenant, (-OFFENDER_LOG_S, Counter()))
        since[reason] += n
        if now - last < OFFENDER_LOG_S:
            self._last[tenant] = (last, since)
            return
        self._log.warning("tenant %s (uid %s, pid %d) is at its %s share: refused %s in the last minute",
                          tenant, uid, pid, level, ", ".join(f"{k}={v}" for k, v in sorted(since.items())))
        self._last[tenant] = (now, Counter())
        if len(self._last) > _MAX_LOGGED:
            oldest = min(self._last, key=lambda t: self._last[t][0])
            del self._last[oldest]
