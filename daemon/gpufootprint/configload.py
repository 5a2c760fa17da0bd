"""Configuration loading: YAML file < environment (GPUFOOTPRINT_...) < command line.

``load_config`` merges the three levels into plain dicts first, then builds the
schema's dataclasses (config.py) and validates once, so an error always names the
full key path, the bad value and the level it came from.

Environment names: ``GPUFOOTPRINT_`` + the key path upper-cased with ``__``
between levels, e.g. ``GPUFOOTPRINT_EXPORTER__LISTEN=0.0.0.0:9878``. Values are
parsed as YAML scalars, so ``60`` is a number and ``true`` a boolean. Other ``GPUFOOTPRINT_*``
names (no ``__``: the variables Kubernetes makes for a Service named gpufootprint) are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gpufootprint.config import Config
from gpufootprint.errors import ConfigError
from gpufootprint.wire.probe_options import COPY_MODES as PROBE_COPY_MODES
from gpufootprint.wire.probe_options import copy_mode as probe_copy_mode

ENV_PREFIX = "GPUFOOTPRINT_"



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
        if "__" not in name[len(ENV_PREFIX):]:
            # Not ours: only GPUFOOTPRINT_<SECTION>__<KEY> is configuration. Kubernetes injects
            # GPUFOOTPRINT_PORT=tcp://... and friends for a Service named gpufootprint.
            continue
        keypath = name[len(ENV_PREFIX):].lower().split("__")
        # YAML 1.1 reads 0666 as the octal number 438: keep permission modes as written.
        value = raw if keypath[-1].endswith("mode") and raw.strip().isdigit() else \
            _parse_scalar(raw, f"environment {name}")
        _set_path(tree, keypath, value, origin, f"environment {name}")
    for dotted, value in (overrides or {}).items():
        _set_path(tree, dotted.split("."), value, origin, "command line")
    config: Config = _build(Config, tree, (), origin)
    _check_relations(config, origin)
    validate_engine_config(config, origin)
    return config


def build_config(tree: Mapping[str, Any], source: str) -> Config:
    """A configuration from one mapping, every key of which came from ``source`` (named in errors).

    Only the schema is checked (unknown keys, types, ranges, keys bounded by each other); ``load_config``
    also checks the engine tables (``validate_engine_config``), which a caller that needs them runs itself.
    """
    origin = {leaf: source for leaf in _leaf_paths(tree, ())}
    config: Config = _build(Config, tree, (), origin)
    _check_relations(config, origin)
    return config


def parse_set_option(text: str) -> tuple[str, Any]:
    """``--set a.b=value`` -> ("a.b", parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"command line: --set expects KEY.PATH=VALUE, got {text!r}")
    return key.strip(), _parse_scalar(raw, f"command line --set {key}")


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _read_yaml(path: Path) -> dict[str, Any]:
    from gpufootprint.yamlsafe import read_yaml_file  # no aliases, bounded depth and size

    data = read_yaml_file(path)
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
        if math.isnan(value):  # YAML's .nan: every bound compares false with it, so none would catch it
            raise ConfigError(f"{where}: expected a number, got .nan")
    elif base is str:
        if isinstance(value, int) and not isinstance(value, bool) and path[-1].endswith("mode"):
            # YAML 1.1 reads an unquoted 0600 as the octal number 384; an unquoted 660 is the
            # decimal 660 whose digits were meant as octal. Quoting ("0660") avoids both guesses.
            digits = str(value)
            value = digits.zfill(4) if value > 0o777 and set(digits) <= set("01234567") else f"{value:04o}"
        if isinstance(value, bool) and meta.get("choices") == PROBE_COPY_MODES:
            value = probe_copy_mode(str(value))  # YAML 1.1 reads an unquoted off as false
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


def _check_relations(config: Config, origin: dict[str, str]) -> None:
    """Keys whose bounds are each other: each alone is in range, together they must agree."""
    sampler = config.sampler
    if sampler.max_ms < sampler.steady_ms:
        raise ConfigError(f"{_src(origin, ('sampler', 'max_ms'))}sampler.max_ms: {sampler.max_ms} is below "
                          f"sampler.steady_ms ({sampler.steady_ms}): quiet intervals grow from steady_ms up to it")


def parse_listen(value: str, where: str = "listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _src(origin: dict[str, str], path: tuple[str, ...]) -> str:
    dotted = ".".join(path)
    source = origin.get(dotted)
    if source is None and dotted:  # a section: where its first leaf came from
        source = next((src for key, src in sorted(origin.items()) if key.startswith(dotted + ".")), None)
    return f"{source}: " if source else ""


# --- engine tables ------------------------------------------------------------

BUDGET_SCOPES = ("process", "pod", "namespace", "gpu")
_RULE_KEYS = {"scope", "name", "bytes", "fraction", "soft_action", "hard_action", "soft_fraction"}


def validate_engine_config(config: Config, origin: dict[str, str] | None = None) -> None:
    """Check the list/table keys the dataclass schema cannot type; errors name the key path."""
    origin = origin or {}
    rules = config.budgets.rules
    if not isinstance(rules, list):
        raise ConfigError(f"{_src(origin, ('budgets', 'rules'))}budgets.rules: expected a list, got {rules!r}")
    for i, rule in enumerate(rules):
        where = f"{_src(origin, ('budgets', 'rules'))}budgets.rules[{i}]"
        if not isinstance(rule, dict):
            raise ConfigError(f"{where}: expected a mapping, got {rule!r}")
        unknown = set(rule) - _RULE_KEYS
        if unknown:
            raise ConfigError(f"{where}.{min(unknown)}: unknown key (known: {', '.join(sorted(_RULE_KEYS))})")
        if rule.get("scope") not in BUDGET_SCOPES:
            raise ConfigError(f"{where}.scope: {rule.get('scope')!r} is not one of {', '.join(BUDGET_SCOPES)}")
        if not isinstance(rule.get("name"), (str, int)) or isinstance(rule.get("name"), bool):
            raise ConfigError(f"{where}.name: expected a name, id or '*', got {rule.get('name')!r}")
        has_bytes, has_fraction = rule.get("bytes") is not None, rule.get("fraction") is not None
        if has_bytes == has_fraction:
            raise ConfigError(f"{where}: give exactly one of bytes or fraction")
        if has_bytes and (isinstance(rule["bytes"], bool) or not isinstance(rule["bytes"], int) or rule["bytes"] < 0):
            raise ConfigError(f"{where}.bytes: expected a non-negative integer, got {rule['bytes']!r}")
        for key, lo, hi in (("fraction", 0.0, 1.0), ("soft_fraction", 0.0, 1.0)):
            if rule.get(key) is not None:
                v = rule[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                    raise ConfigError(f"{where}.{key}: expected a number in [{lo}, {hi}], got {v!r}")
        for key in ("soft_action", "hard_action"):
            if key in rule and not isinstance(rule[key], bool):
                raise ConfigError(f"{where}.{key}: expected true or false, got {rule[key]!r}")
    for table, kind in (("prices", float), ("memory_bytes", int)):
        value = getattr(config.cost, table)
        where = f"{_src(origin, ('cost', table))}cost.{table}"
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of GPU model to a number, got {value!r}")
        for model, v in value.items():
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            if kind is int:
                ok = ok and isinstance(v, int)
            if not ok:
                raise ConfigError(f"{where}.{model}: expected a non-negative {kind.__name__}, got {v!r}")


# --- SIGHUP: what a reload changes without a restart ----------------------------

# Configuration keys a SIGHUP applies without a restart: each is read where it is used, per event or per
# tick, so a new value takes effect at once. The rest are reported as needing one.
LIVE_PREFIXES = ("logging.",)
LIVE_KEYS = frozenset({"daemon.tick_ms", "daemon.max_frame_bytes", "daemon.hello_timeout_seconds",
                       "daemon.max_connections", "daemon.max_buffered_bytes", "daemon.max_future_seconds",
                       "exporter.series_cap", "exporter.web_config_file", "exporter.render_interval_ms",
                       # the bounds on what a local process can make the daemon hold (ingest/validate.py)
                       "daemon.max_record_bytes", "daemon.max_devices_per_process", "daemon.max_device_footprints",
                       "daemon.max_live_allocations_per_process", "daemon.max_live_allocations",
                       "daemon.max_pending_records_per_process", "daemon.max_pending_records",
                       "daemon.max_metadata_bytes", "daemon.max_retained_kernels", "daemon.max_processes",
                       "daemon.max_resync_records", "daemon.max_string_bytes",
                       "daemon.tick_stall_seconds"})


def _flatten(tree: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix:  # sections only; tables (prices, rules) compare whole
            out.update(_flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def live_changes(running: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """What a reload to ``new`` does to the ``running`` configuration: the configuration to run with
    (``new``'s values of the live keys, the running values of the rest), the live keys that changed,
    and the changed keys that need a restart."""
    old_flat, new_flat = _flatten(config_to_dict(running)), _flatten(config_to_dict(new))
    changed = sorted(k for k in new_flat.keys() | old_flat.keys() if old_flat.get(k) != new_flat.get(k))
    live = [k for k in changed if k.startswith(LIVE_PREFIXES) or k in LIVE_KEYS]
    later = [k for k in changed if k not in live]
    # Keep the running values of what needs a restart, so the config object tells the truth.
    applied = running
    for key in live:
        section, name = key.split(".", 1)
        applied = dataclasses.replace(applied, **{section: dataclasses.replace(getattr(applied, section),
                                                                             **{name: getattr(getattr(new, section),
                                                                                              name)})})
    return applied, live, later
