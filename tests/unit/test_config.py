"""Configuration: file < environment < command line; errors name the key path and value."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpufootprint.config import Config
from gpufootprint.configload import load_config, parse_set_option
from gpufootprint.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_default_config_is_valid_and_equals_the_built_in_defaults() -> None:
    assert load_config(ROOT / "config" / "gpufootprint.yaml", env={}) == Config()


def test_each_level_overrides_the_one_before(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("footprint:\n  window_peak_seconds: 30\n  frame_ms: 20\nexporter:\n  listen: 1.2.3.4:1\n")
    env = {"GPUFOOTPRINT_FOOTPRINT__FRAME_MS": "5", "GPUFOOTPRINT_EXPORTER__LISTEN": "0.0.0.0:2"}
    cfg = load_config(path, env=env, overrides={"exporter.listen": "127.0.0.1:3"})
    assert cfg.footprint.window_peak_seconds == 30.0  # file
    assert cfg.footprint.frame_ms == 5  # environment over file
    assert cfg.exporter.listen == "127.0.0.1:3"  # command line over both


@pytest.mark.parametrize(
    ("yaml_text", "env", "message"),
    [
        ("footprint:\n  frame_ms: fast\n", {}, "c.yaml: footprint.frame_ms: expected an integer, got 'fast'"),
        ("footprint:\n  frame_ms: 0\n", {}, "footprint.frame_ms: 0 is below the minimum 1"),
        ("leaks:\n  growth_window_seconds: .nan\n", {}, "c.yaml: leaks.growth_window_seconds: expected a number, got .nan"),
        ("", {"GPUFOOTPRINT_BUDGETS__TREND_WINDOW_SECONDS": ".nan"},
         "environment GPUFOOTPRINT_BUDGETS__TREND_WINDOW_SECONDS: budgets.trend_window_seconds: expected a number, got .nan"),
        ("footprint:\n  frme_ms: 3\n", {}, "footprint.frme_ms: unknown key"),
        ("logging:\n  level: loud\n", {}, "logging.level: 'loud' is not one of debug, info, warning, error"),
        ("exporter:\n  listen: nowhere\n", {}, "exporter.listen: 'nowhere' is not HOST:PORT"),
        ("footprint: [1, 2\n", {}, "c.yaml:2: invalid YAML"),
        ("", {"GPUFOOTPRINT_DAEMON__TICK_MS": "-4"},
         "environment GPUFOOTPRINT_DAEMON__TICK_MS: daemon.tick_ms: -4 is below the minimum 5"),
        ("exporter:\n  render_interval_ms: 10\n", {}, "exporter.render_interval_ms: 10 is below the minimum 100"),
        ("exporter:\n  render_interval_ms: soon\n", {}, "exporter.render_interval_ms: expected an integer"),
    ],
)
def test_errors_name_where_the_bad_value_came_from(tmp_path: Path, yaml_text: str, env: dict[str, str],
                                                   message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_set_option_parses_yaml_scalars() -> None:
    assert parse_set_option("footprint.frame_ms=7") == ("footprint.frame_ms", 7)
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_set_option("nonsense")


@pytest.mark.parametrize(("text", "mode"), [("0600", "0600"), ("0660", "0660"), ("660", "0660"), ('"0640"', "0640")])
def test_socket_mode_in_yaml_means_what_it_looks_like(tmp_path: Path, text: str, mode: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"daemon:\n  socket_mode: {text}\n")
    assert load_config(path, env={}).daemon.socket_mode == mode


def test_the_shipped_config_lists_every_key() -> None:
    import dataclasses

    import yaml

    def keys(obj: object, prefix: str = "") -> set[str]:
        out = set()
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            out |= keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name}
        return out

    def yaml_keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            sub = yaml_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and k not in ("prices", "memory_bytes") else None
            out |= sub if sub else {prefix + k}
        return out

    shipped = yaml.safe_load((ROOT / "config" / "gpufootprint.yaml").read_text())
    assert yaml_keys(shipped) == keys(Config())


def test_probe_section_defaults_are_the_probes_own() -> None:
    import dataclasses

    from gpufootprint.config import ProbeConfig
    from gpufootprint.probe.settings import ProbeSettings

    ours = {f.name: getattr(ProbeConfig(), f.name) for f in dataclasses.fields(ProbeConfig)}
    probe = {f.name: getattr(ProbeSettings(), f.name) for f in dataclasses.fields(ProbeSettings)}
    assert set(ours) <= set(probe)
    assert {k: probe[k] for k in ours} == ours


def test_probe_buffer_smaller_than_one_frame_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("probe:\n  buffer_bytes: 65536\n")
    with pytest.raises(ConfigError, match="probe.buffer_bytes: 65536 is below the minimum 1048576"):
        load_config(path, env={})


def test_kubernetes_service_link_variables_are_not_configuration() -> None:
    # A ClusterIP Service named gpufootprint makes Kubernetes inject these into every pod of the namespace.
    links = {"GPUFOOTPRINT_PORT": "tcp://10.96.0.12:9878", "GPUFOOTPRINT_PORT_9878_TCP": "tcp://10.96.0.12:9878",
             "GPUFOOTPRINT_PORT_9878_TCP_ADDR": "10.96.0.12", "GPUFOOTPRINT_PORT_9878_TCP_PORT": "9878",
             "GPUFOOTPRINT_PORT_9878_TCP_PROTO": "tcp", "GPUFOOTPRINT_SERVICE_HOST": "10.96.0.12",
             "GPUFOOTPRINT_SERVICE_PORT": "9878", "GPUFOOTPRINT_SERVICE_PORT_METRICS": "9878"}
    assert load_config(env=links) == Config()
    cfg = load_config(env={**links, "GPUFOOTPRINT_EXPORTER__LISTEN": "127.0.0.1:9"})
    assert cfg.exporter.listen == "127.0.0.1:9"


def test_a_misspelt_section_in_the_environment_is_still_refused() -> None:
    with pytest.raises(ConfigError, match="GPUFOOTPRINT_EXPORTR__LISTEN"):
        load_config(env={"GPUFOOTPRINT_EXPORTR__LISTEN": "127.0.0.1:9"})
