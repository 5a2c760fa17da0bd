"""Configuration: YAML file < environment (GPUFOOTPRINT_...) < command line.

The schema is a tree of frozen dataclasses; every leaf has a type, a default and
optional bounds. ``load_config`` merges the three levels into plain dicts first,
then validates once, so an error always names the full key path, the bad value
and the level it came from.

Environment names: ``GPUFOOTPRINT_`` + the key path upper-cased with ``__``
between levels, e.g. ``GPUFOOTPRINT_EXPORTER__LISTEN=0.0.0.0:9878``. Values are
parsed as YAML scalars, so ``60`` is a number and ``true`` a boolean.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufootprint.errors import ConfigError

ENV_PREFIX = "GPUFOOTPRINT_"


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


@dataclass(frozen=True)
class ExporterConfig:
    listen: str = _spec("0.0.0.0:9878", doc="HOST:PORT of /metrics, /healthz, /readyz")
    # issue 6: cardinality and pod labels
    series_cap: int = _spec(2000, lo=2, hi=10_000_000,
                            doc="max series per metric; past it one pid=\"__overflow__\" series carries the sum")
    extra_pod_labels: str = _spec("", doc="comma-separated pod label keys exported as label_<key> "
                                          "(kubernetes.mode sidecar or daemonset)")


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
    format: str = _spec("text", choices=("text", "json"))


@dataclass(frozen=True)
class DemoConfig:
    speed: float = _spec(1.0, lo=0.001, hi=1e6, doc="replay speed relative to real time")
    trace: str | None = _spec(None, doc="trace to loop (None: the bundled H200 traces)")


@dataclass(frozen=True)
class KubernetesConfig:
    """Issue 6: pod, namespace and container labels on per-process series (docs/kubernetes.md)."""

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
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    footprint: FootprintConfig = field(default_factory=FootprintConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)


# --- loading ------------------------------------------------------------------


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file, environment and command-line overrides (``{"a.b": value}``) and validate."""
    tree: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        file_tree = _read_yaml(Path(path))
        _merge(tree, file_tree, origin, str(path))
    env = os.environ if env is None else env
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in (ENV_PREFIX + "PROBE", ENV_PREFIX + "CONFIG"):
            continue
        if name.startswith(ENV_PREFIX + "PROBE_"):
            continue  # the probe's own environment, read inside workloads
        keypath = name[len(ENV_PREFIX):].lower().split("__")
        # YAML 1.1 reads 0666 as the octal number 438: keep permission modes as written.
        value = raw if keypath[-1].endswith("mode") and raw.strip().isdigit() else \
            _parse_scalar(raw, f"environment {name}")
        _set_path(tree, keypath, value, origin, f"environment {name}")
    for dotted, value in (overrides or {}).items():
        _set_path(tree, dotted.split("."), value, origin, "command line")
    return _build(Config, tree, (), origin)


def parse_set_option(text: str) -> tuple[str, Any]:
    """``--set a.b=value`` -> ("a.b", parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"command line: --set expects KEY.PATH=VALUE, got {text!r}")
    return key.strip(), _parse_scalar(raw, f"command line --set {key}")


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _parse_scalar(raw: str, where: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"{where}: cannot parse value {raw!r}") from None


def _merge(tree: dict[str, Any], new: Mapping[str, Any], origin: dict[str, str], source: str,
           prefix: tuple[str, ...] = ()) -> None:
    for key, value in new.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value, origin, source, path)
        else:
            tree[str(key)] = value
            origin[".".join(path)] = source
            if isinstance(value, dict):
                for sub in _leaf_paths(value, path):
                    origin[sub] = source


def _leaf_paths(value: Mapping[str, Any], prefix: tuple[str, ...]) -> list[str]:
    out = []
    for key, sub in value.items():
        path = (*prefix, str(key))
        out.extend(_leaf_paths(sub, path) if isinstance(sub, dict) else [".".join(path)])
    return out


def _set_path(tree: dict[str, Any], keypath: list[str], value: Any, origin: dict[str, str], source: str) -> None:
    node = tree
    for part in keypath[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[keypath[-1]] = value
    origin[".".join(keypath)] = source


def _build(cls: type, data: Any, path: tuple[str, ...], origin: dict[str, str]) -> Any:
    where = ".".join(path) or "<top level>"
    if not isinstance(data, dict):
        raise ConfigError(f"{_src(origin, path)}{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{_src(origin, (*path, key))}{'.'.join((*path, key))}: unknown key "
                              f"(known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            continue
        sub = (*path, name)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(typing.cast(type, hint), data[name], sub, origin)
        else:
            kwargs[name] = _check_leaf(hint, data[name], f.metadata, sub, origin)
    return cls(**kwargs)


def _check_leaf(hint: Any, value: Any, meta: Mapping[str, Any], path: tuple[str, ...],
                origin: dict[str, str]) -> Any:
    where = f"{_src(origin, path)}{'.'.join(path)}"
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{where}: a value is required, got null")
    base = next((t for t in allowed if t is not type(None)), str)
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
    elif base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    elif base is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and path[-1].endswith("mode"):
            value = f"{value:04d}" if isinstance(value, int) else str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
    lo, hi, choices = meta.get("lo"), meta.get("hi"), meta.get("choices")
    if lo is not None and value < lo:
        raise ConfigError(f"{where}: {value!r} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}: {value!r} is above the maximum {hi}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    if path[-1] == "listen":
        parse_listen(value, where)
    if path[-1] == "socket_mode":
        try:
            int(value, 8)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not an octal mode like 0600") from None
    return value


def parse_listen(value: str, where: str = "listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _src(origin: dict[str, str], path: tuple[str, ...]) -> str:
    source = origin.get(".".join(path))
    return f"{source}: " if source else ""
