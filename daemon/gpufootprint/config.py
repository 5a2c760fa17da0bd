"""Configuration schema: every key of the daemon's configuration, one section per stage.

The schema is a tree of frozen dataclasses; every leaf has a type, a default and
optional bounds (``_spec``). Reading it (YAML file < environment < command line),
checking it and naming the source of a bad value is configload.py's.

Why one module of about 350 lines: it is the whole schema, so a key, its bounds and
its doc are found in one place; the probe's section is the probe's options
(``wire/probe_options.py``, shared with the probe), imported rather than written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpufootprint.wire.probe_options import ProbeOptions


def _spec(default: Any, *, lo: float | None = None, hi: float | None = None,
          choices: tuple[str, ...] | None = None, doc: str = "") -> Any:
    return field(default=default, metadata={"lo": lo, "hi": hi, "choices": choices, "doc": doc})


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = _spec("/run/gpufootprint/probe.sock", doc="Unix socket the probes connect to")
    socket_mode: str = _spec("0600", doc="octal permission bits of the socket")
    socket_group: str | None = _spec(None, doc="group that owns the socket (None: the daemon's)")
    tick_ms: int = _spec(100, lo=5, hi=10_000, doc="how often the snapshot is rebuilt")
    max_frame_bytes: int = _spec(16 * 1024 * 1024, lo=1024, hi=1 << 30, doc="larger frames are refused")
    # Limits on what probes can make the daemon hold: any local process may connect (docs/reliability.md)
    hello_timeout_seconds: float = _spec(10.0, lo=0, hi=3600,
                                         doc="a connection that has not sent its HELLO by then is cut off (0: never)")
    max_connections: int = _spec(1024, lo=1, hi=1_000_000,
                                 doc="probe connections at most; more are accepted and closed at once, counted")
    max_buffered_bytes: int = _spec(64 * 1024 * 1024, lo=1 << 16, hi=1 << 34,
                                    doc="partial frames held across all connections; past it the largest holder "
                                        "is cut off")
    max_future_seconds: float = _spec(300.0, lo=0, hi=86_400 * 365,
                                      doc="live records stamped further ahead of the daemon's clock are clamped "
                                          "to it and counted")
    # What one local process can make the daemon hold (docs/reliability.md gives the memory each implies).
    max_record_bytes: int = _spec(1 << 42, lo=1 << 20, hi=(1 << 62) // 1_000_000,
                                  doc="a record whose size or byte count is larger is dropped (bad_size)")
    max_devices_per_process: int = _spec(16, lo=1, hi=4096,
                                         doc="device numbers at or above it are dropped (bad_device)")
    max_device_footprints: int = _spec(2048, lo=1, hi=1_000_000,
                                       doc="(process, device) tables in all (a full node: 256 processes on 8 "
                                           "GPUs each); records opening more than a share are dropped")
    max_live_allocations_per_process: int = _spec(100_000, lo=1, hi=10_000_000,
                                                  doc="live allocations (with records still waiting) one process "
                                                      "may hold; further allocations are dropped and counted")
    max_live_allocations: int = _spec(250_000, lo=1, hi=100_000_000,
                                      doc="live allocations of all processes together")
    max_pending_records_per_process: int = _spec(250_000, lo=1000, hi=10_000_000,
                                                 doc="records waiting for a process's watermark; past it they are "
                                                     "applied at once (pending_limit)")
    max_pending_records: int = _spec(400_000, lo=1000, hi=100_000_000,
                                     doc="records waiting for the watermark in all processes together")
    max_resync_records: int = _spec(400_000, lo=1000, hi=100_000_000,
                                    doc="records held in open resyncs of all processes together (shared by "
                                        "tenant); past its share a resync is cut (resync_limit)")
    max_string_bytes: int = _spec(16 * 1024 * 1024, lo=1 << 16, hi=1 << 32,
                                  doc="kernel names held for all live connections, in characters plus 64 "
                                      "per name (shared by tenant); past its share a name is dropped "
                                      "(strings_limit)")
    max_metadata_bytes: int = _spec(8 * 1024, lo=1024, hi=1 << 24,
                                    doc="JSON bytes of HELLO/META fields one process may keep; a META past it is "
                                        "dropped")
    max_retained_kernels: int = _spec(500_000, lo=0, hi=100_000_000,
                                      doc="KERNEL and launch records the graph advisor keeps for all processes "
                                          "together (graph_advisor.kernel_retention of each each); at its share "
                                          "a process's newest records replace its oldest, and a batch larger "
                                          "than the whole share loses its oldest (kernel_limit)")
    max_processes: int = _spec(1024, lo=1, hi=1_000_000,
                               doc="processes held in all; past it the longest-exited are forgotten early")
    tick_stall_seconds: float = _spec(10.0, lo=0.1, hi=3600,
                                      doc="/readyz fails when no tick has succeeded for this long")


@dataclass(frozen=True)
class ExporterConfig:
    listen: str = _spec("0.0.0.0:9878", doc="HOST:PORT of /metrics, /healthz, /readyz")
    # Cardinality and pod labels: what bounds the series one scrape returns
    series_cap: int = _spec(2000, lo=2, hi=10_000_000,
                            doc="max series per metric; past it one pid=\"__overflow__\" series carries the sum")
    extra_pod_labels: str = _spec("", doc="comma-separated pod label keys exported as label_<key> "
                                          "(kubernetes.mode sidecar or daemonset)")
    # TLS and basic auth, in the Prometheus exporter-toolkit web config format (one file operators already know)
    web_config_file: str | None = _spec(None, doc="YAML with tls_server_config and basic_auth_users "
                                                  "(exporter-toolkit format; None: plain HTTP, no auth)")
    max_label_value_length: int = _spec(256, lo=16, hi=65_536,
                                        doc="longer label values are cut (with a hash suffix); control "
                                            "characters are replaced")
    render_interval_ms: int = _spec(1000, lo=100, hi=60_000,
                                    doc="how often the /metrics body is rendered ahead of the scrapes")


@dataclass(frozen=True)
class FootprintConfig:
    window_peak_seconds: float = _spec(60.0, lo=0.01, hi=86_400, doc="trailing window of the peak gauge")
    frame_ms: int = _spec(10, lo=1, hi=10_000, doc="frame width: time resolution of peaks")
    reorder_window_ms: int = _spec(500, lo=0, hi=600_000, doc="how long records wait to be put in time order")
    process_grace_seconds: float = _spec(300.0, lo=0, hi=86_400 * 7,
                                         doc="series of an exited process stay this long")


@dataclass(frozen=True)
class LoggingConfig:
    level: str = _spec("info", choices=("debug", "info", "warning", "error"))
    format: str = _spec("logfmt", choices=("logfmt", "text", "json"), doc="text: the older name of logfmt")


@dataclass(frozen=True)
class DemoConfig:
    speed: float = _spec(1.0, lo=0.001, hi=1e6, doc="replay speed relative to real time")
    trace: str | None = _spec(None, doc="trace to loop (None: the bundled H200 traces)")


# --- feature frames, adaptive sampler, NVML -----------------------------------


@dataclass(frozen=True)
class FeaturesConfig:
    keep_seconds: float = _spec(10.0, lo=0.05, hi=3600, doc="how much frame history each (pid, gpu) keeps")
    migration_window_ms: int = _spec(50, lo=1, hi=60_000,
                                     doc="window of the page-migration frequency (UM + host<->device copies)")
    reuse_tracked_addresses: int = _spec(100_000, lo=1, hi=100_000_000,
                                         doc="freed (address, size) pairs remembered for the reuse ratio "
                                             "(about 100 bytes each; forgotten all at once when full)")
    history_tables: int = _spec(8, lo=1, hi=1_000_000,
                                doc="(pid, gpu) tables that keep the whole history above; with more, each "
                                    "keeps its part of it (a full node: 2,048 tables), so the daemon's memory "
                                    "for histories stays that of this many")


@dataclass(frozen=True)
class SamplerConfig:
    enabled: bool = _spec(True, doc="run the adaptive sampler (False: fixed steady interval, no windows)")
    steady_ms: int = _spec(20, lo=1, hi=60_000, doc="interval when neither quiet nor volatile")
    # At most the probe's longest flush interval (ProbeOptions.flush_ms): a longer one would be cut to it.
    max_ms: int = _spec(200, lo=1, hi=1000, doc="quiet intervals double up to this (at least steady_ms)")
    burst_ms: int = _spec(5, lo=1, hi=60_000, doc="frame width inside a burst")
    burst_min_frames: int = _spec(3, lo=1, hi=10_000, doc="a burst lasts at least this many calm frames")
    burst_settle_ms: int = _spec(100, lo=0, hi=600_000,
                                 doc="a level held away from the pre-burst baseline this long ends the burst")
    burst_max_ms: int = _spec(2000, lo=1, hi=3_600_000, doc="an anomaly window is closed after this long")
    volatile_rel_change: float = _spec(0.05, lo=0.0, hi=1e6,
                                       doc="footprint range / level in one interval that counts as volatile")
    volatile_min_bytes: int = _spec(1 << 20, lo=0, hi=1 << 50, doc="smaller footprint changes are never volatile")
    range_jump_factor: float = _spec(2.0, lo=0.0, hi=1e6,
                                     doc="volatile range must also exceed this times the usual (EWMA) range")
    rate_jump_factor: float = _spec(4.0, lo=1.0, hi=1e6, doc="event rate this many times the usual is volatile")
    rate_min_events: int = _spec(50, lo=1, hi=1 << 30, doc="fewer events in an interval never count as a rate jump")
    quiet_max_rate: float = _spec(100.0, lo=0.0, hi=1e9, doc="events per second at or below which it may be quiet")
    quiet_rel_change: float = _spec(0.01, lo=0.0, hi=1e6, doc="footprint range / level at or below which it is quiet")
    ewma_alpha: float = _spec(0.2, lo=0.0, hi=1.0, doc="weight of the newest interval in the usual rate and range")
    history: int = _spec(4096, lo=1, hi=10_000_000, doc="interval-history entries kept per process")
    max_windows: int = _spec(1000, lo=1, hi=10_000_000, doc="recent anomaly windows kept (all processes)")
    control: bool = _spec(True, doc="send flush_interval to probes when the interval changes")
    kernel_window_ms: int = _spec(50, lo=0, hi=60_000,
                                  doc="open a window of the probe's launch (or kernel) records, periodically and "
                                      "at a burst (0: never; the CUDA Graph advisor reads them): kernel records "
                                      "this long; launch records at least this long, then until "
                                      "kernel_window_steps steps or a bound")
    kernel_window_records: str = _spec("launches", choices=("launches", "kernels"),
                                       doc="what a window records: launches (the launch and wait calls on the "
                                           "host; no lasting cost measured) or kernels (CUPTI's kernel records: "
                                           "exact kernel durations, but a lasting slowdown of about 10 % on "
                                           "launch-bound loops on the H200, docs/performance.md)")
    kernel_window_steps: int = _spec(4, lo=1, hi=10_000,
                                    doc="a launch window stays open until it holds this many whole steps "
                                        "(launches between two waits for the GPU): the probe closes it as soon as "
                                        "it has counted them, the daemon once it has read them")
    kernel_window_max_ms: int = _spec(12_000, lo=1, hi=60_000,
                                      doc="... or for this long at most (4 steps of 2 s, the one it opened in, and a lag)")
    kernel_window_max_records: int = _spec(50_000, lo=1, hi=10_000_000,
                                           doc="... or until the daemon has read this many of its calls (a "
                                               "flush or two more may still come)")
    kernel_window_every_seconds: float = _spec(30.0, lo=0, hi=86_400,
                                               doc="a kernel window this often per process (0: only at bursts)")
    kernel_window_first_seconds: float = _spec(5.0, lo=0, hi=86_400,
                                               doc="the first periodic window, this long after a process's first "
                                                   "watermark (past its start-up)")
    kernel_window_min_gap_seconds: float = _spec(1.0, lo=0, hi=86_400,
                                                 doc="windows (periodic or at bursts) at least this far apart, "
                                                     "from the last one's close")
    kernel_window_burst_gap_seconds: float = _spec(30.0, lo=0, hi=86_400,
                                                   doc="a burst opens a window only when none opened this long "
                                                       "before (under allocation churn a burst starts every "
                                                       "second; 0: every burst, past the gap)")
    kernel_window_every_max_seconds: float = _spec(600.0, lo=0, hi=86_400,
                                                   doc="each window a process has had doubles both gaps above "
                                                       "(periodic and burst) for its next one, up to this long "
                                                       "(0: no back-off): every window's switches may leave "
                                                       "launches from threads other than the main one slower for "
                                                       "good (docs/performance.md), so a long job gets a few a "
                                                       "hour, not one every 30 s")


@dataclass(frozen=True)
class NvmlConfig:
    enabled: bool = _spec(True, doc="poll NVML when a driver is present")
    min_poll_ms: int = _spec(20, lo=1, hi=600_000, doc="fastest poll (while a process bursts)")
    max_poll_ms: int = _spec(1000, lo=1, hi=600_000, doc="slowest poll (when everything is quiet)")
    lost_retry_seconds: float = _spec(10.0, lo=0.0, hi=86_400, doc="how often a lost GPU is looked for again")
    pcie_samples: int = _spec(1200, lo=1, hi=10_000_000, doc="recent PCIe samples kept per GPU for alignment")
    xid_events: bool = _spec(True, doc="register for Xid (critical error) events where supported")


@dataclass(frozen=True)
class ProbeConfig(ProbeOptions):
    """Settings handed to probes started by ``gpufootprint run`` (as GPUFOOTPRINT_PROBE_* variables).

    The probe's options (wire/probe_options.py, shared with the probe): names, defaults, bounds and
    docs are written once, there.
    """


# --- decision engines ---------------------------------------------------------
# Lists and tables (budget rules, the price table) are checked by
# ``validate_engine_config`` so an error still names its key path.


@dataclass(frozen=True)
class GraphAdvisorConfig:
    enabled: bool = _spec(True, doc="run the CUDA Graph advisor on retained kernel records")
    min_op_count: int = _spec(8, lo=1, hi=1_000_000, doc="capture needs at least this many kernels per step")
    min_mean_kernel_ms: float = _spec(0.5, lo=0, hi=60_000, doc="capture needs this mean kernel duration")
    max_op_count: int | None = _spec(None, lo=1, hi=1_000_000,
                                     doc="capture needs at most this many kernels per step (None: no upper bound)")
    max_mean_kernel_ms: float | None = _spec(None, lo=0, hi=60_000,
                                             doc="capture needs at most this mean kernel duration: launch-bound "
                                                 "steps of tiny kernels (None: no upper bound)")
    min_reuse: float = _spec(0.7, lo=0, hi=1, doc="capture needs this allocation reuse ratio")
    max_reuse: float | None = _spec(None, lo=0, hi=1, doc="capture needs at most this reuse ratio (None: no bound)")
    allow_unknown_reuse: bool = _spec(False, doc="treat an unknown reuse ratio as passing")
    captured_share: float = _spec(0.5, lo=0, hi=1,
                                  doc="a stream whose kernels come from graphs at least this share is captured")
    min_steps: int = _spec(3, lo=2, hi=10_000, doc="repetitions of the step needed to trust its period")
    min_match: float = _spec(0.9, lo=0.5, hi=1, doc="share of kernels that must repeat at the period")
    max_period: int = _spec(4096, lo=1, hi=1_000_000, doc="longest step (in kernels) looked for")
    analysis_kernels: int = _spec(16384, lo=16, hi=10_000_000, doc="newest kernels per stream analysed")
    kernel_retention: int = _spec(65536, lo=0, hi=10_000_000,
                                  doc="KERNEL records, and as many host-side launch records, kept per process "
                                      "for the advisor (0: none)")
    host_gap_ms: float = _spec(1.0, lo=0, hi=60_000,
                               doc="gaps longer than this are host work a graph does not remove")
    graph_gap_us: float = _spec(2.0, lo=0, hi=1_000_000, doc="gap between kernels of a replayed graph")
    gpu_busy: bool = _spec(True, doc="bound the mean kernel duration of launch windows from below by NVML's "
                                     "per-process utilisation over their steps (engines/busy.py)")
    busy_error: float = _spec(0.2, lo=0, hi=1,
                              doc="NVML's sampled busy share is taken as at least this much lower (its error "
                                  "against kernel records, docs/engines.md)")


@dataclass(frozen=True)
class BudgetsConfig:
    enabled: bool = _spec(True)
    rules: list[dict[str, Any]] = field(default_factory=list, metadata={
        "doc": "list of {scope: process|pod|namespace|gpu, name: ID or '*', bytes: N | fraction: F, "
               "soft_action: bool, hard_action: bool, soft_fraction: F}"})
    trend_window_seconds: float = _spec(300.0, lo=1, hi=86_400, doc="least-squares window of the usage trend")
    min_trend_points: int = _spec(5, lo=2, hi=100_000, doc="samples needed before predicting exhaustion")
    action_cooldown_seconds: float = _spec(60.0, lo=0, hi=86_400, doc="an action repeats at most this often")


@dataclass(frozen=True)
class LeaksConfig:
    enabled: bool = _spec(True)
    warmup_seconds: float = _spec(120.0, lo=0, hi=86_400, doc="no verdict in a process's first seconds (start-up)")
    growth_window_seconds: float = _spec(240.0, lo=1, hi=86_400 * 7, doc="window of the footprint trend")
    growth_segments: int = _spec(8, lo=2, hi=1000, doc="the window is cut in this many segments; growth is "
                                                       "sustained when the segments' floors keep rising")
    min_rising_share: float = _spec(0.75, lo=0, hi=1, doc="share of segment-to-segment steps whose floor must "
                                                          "rise (a single step up is not growth)")
    min_growth_bytes_per_second: float = _spec(1024.0, lo=0, hi=1e15, doc="the footprint must grow this fast")
    min_age_seconds: float = _spec(60.0, lo=0, hi=86_400 * 30,
                                   doc="allocations made since the growth began and older than this are suspects")
    min_suspect_bytes: int = _spec(1 << 20, lo=0, hi=1 << 50, doc="suspect bytes below this are ignored")
    min_trend_points: int = _spec(5, lo=2, hi=100_000)
    top_sites: int = _spec(5, lo=1, hi=100, doc="allocation sites reported per process")


@dataclass(frozen=True)
class DegradationConfig:
    enabled: bool = _spec(True)
    low_utilization: float = _spec(0.30, lo=0, hi=1, doc="GPU utilisation below this ...")
    low_utilization_seconds: float = _spec(300.0, lo=1, hi=86_400 * 7, doc="... for this long: smaller GPU")
    memory_quota_ratio: float = _spec(0.80, lo=0, hi=10, doc="requested memory above this share of the quota")


#: Example list prices, $ per GPU-hour (on-demand cloud, late 2026); replace with your own.
DEFAULT_PRICES: dict[str, float] = {"H200": 3.80, "H100": 2.90, "A100": 1.60, "L40S": 1.10, "L4": 0.70, "T4": 0.35}
#: Memory per model in bytes, used when NVML does not say.
DEFAULT_MEMORY: dict[str, int] = {"H200": 150_754_820_096, "H100": 85_520_809_984, "A100": 85_899_345_920,
                                  "L40S": 48_305_799_168, "L4": 24_152_899_584, "T4": 16_106_127_360}


@dataclass(frozen=True)
class CostConfig:
    enabled: bool = _spec(True)
    prices: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PRICES), metadata={
        "doc": "$ per GPU-hour by model name (matched as a substring of the NVML name)"})
    memory_bytes: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MEMORY), metadata={
        "doc": "GPU memory by model, when NVML does not report it"})
    default_model: str | None = _spec(None, doc="model assumed for GPUs NVML does not describe (None: unpriced)")
    max_interval_seconds: float = _spec(60.0, lo=0.001, hi=86_400,
                                        doc="longer gaps between snapshots are not accrued")
    forget_after_seconds: float = _spec(600.0, lo=0, hi=86_400 * 7,
                                        doc="a process absent from snapshots this long loses its cost series")


@dataclass(frozen=True)
class KubernetesConfig:
    """Pod, namespace and container labels on per-process series (docs/kubernetes.md)."""

    mode: str = _spec("off", choices=("off", "sidecar", "daemonset"),
                      doc="off: no pod labels; sidecar: from the Downward API env; daemonset: cgroup + API")
    pod_name_env: str = _spec("POD_NAME", doc="sidecar: env var holding the pod name")
    namespace_env: str = _spec("POD_NAMESPACE", doc="sidecar: env var holding the namespace")
    container_env: str = _spec("CONTAINER_NAME", doc="sidecar: env var holding the workload container's name")
    labels_file: str | None = _spec(None, doc="sidecar: Downward API volume file of metadata.labels")
    node_name_env: str = _spec("NODE_NAME", doc="daemonset: env var holding spec.nodeName")
    api_server: str | None = _spec(None, doc="daemonset: API URL (None: from KUBERNETES_SERVICE_HOST/PORT)")
    token_file: str = _spec("/var/run/secrets/kubernetes.io/serviceaccount/token")
    ca_file: str | None = _spec("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    proc_root: str = _spec("/proc", doc="daemonset: where /proc/PID/cgroup is read (hostPID: the host's)")
    pod_refresh_seconds: float = _spec(30.0, lo=1, hi=86_400, doc="daemonset: pod list refresh period")
    unresolved_retry_seconds: float = _spec(5.0, lo=0.1, hi=86_400,
                                            doc="daemonset: earliest re-list after an unknown container")
    api_timeout_seconds: float = _spec(2.0, lo=0.1, hi=60)


@dataclass(frozen=True)
class OomConfig:
    """What the daemon keeps and writes when a probed process runs out of GPU memory (docs/oom.md)."""

    enabled: bool = _spec(True, doc="keep each process's recent records and write a capture at each OOM")
    directory: str = _spec("", doc="where captures are written (created if missing); empty: "
                                   "/var/lib/gpufootprint/oom as root, else $XDG_STATE_HOME/gpufootprint/oom")
    seconds: float = _spec(60.0, lo=1, hi=3600, doc="a capture holds the records of this many seconds before the OOM")
    max_captures: int = _spec(20, lo=1, hi=100_000, doc="captures kept; the oldest is removed first")
    max_buffer_bytes: int = _spec(16 << 20, lo=1 << 16, hi=1 << 34,
                                  doc="recent records kept per process at most (oldest dropped first)")
    max_total_buffer_bytes: int = _spec(32 << 20, lo=1 << 16, hi=1 << 36,
                                        doc="recent records kept for all processes together (the process "
                                            "holding the most loses its oldest first)")
    coalesce_seconds: float = _spec(1.0, lo=0, hi=600,
                                    doc="OOM notices of one process within this long of the first are one event, made "
                                        "then (a framework retries after freeing its cache; PyTorch's observer adds "
                                        "its own notice)")
    episode_quiet_seconds: float = _spec(60.0, lo=0, hi=86_400,
                                         doc="after an event, OOM notices of the process count into it (no new "
                                             "event or capture) until it has been this long without one")
    report: bool = _spec(True, doc="write report.html next to each capture (plots need the [report] extra)")


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    footprint: FootprintConfig = field(default_factory=FootprintConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    graph_advisor: GraphAdvisorConfig = field(default_factory=GraphAdvisorConfig)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    leaks: LeaksConfig = field(default_factory=LeaksConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    oom: OomConfig = field(default_factory=OomConfig)
