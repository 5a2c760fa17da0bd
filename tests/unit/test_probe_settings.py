from __future__ import annotations

from gpufootprint.probe.settings import ProbeSettings


def test_environment_values_are_read_and_bad_ones_fall_back_to_defaults() -> None:
    s = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_FLUSH_MS": "25", "GPUFOOTPRINT_PROBE_KERNELS": "yes",
                                "GPUFOOTPRINT_PROBE_BUFFER_BYTES": "lots", "GPUFOOTPRINT_PROBE_SOCKET": "/x.sock"})
    assert (s.flush_ms, s.kernels, s.socket) == (25, True, "/x.sock")
    assert s.buffer_bytes == ProbeSettings().buffer_bytes


def test_overrides_win_over_the_environment_and_round_trip_through_env() -> None:
    s = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_FLUSH_MS": "25"}, flush_ms=7, socket=None)
    assert s.flush_ms == 7 and s.socket == ProbeSettings().socket
    assert ProbeSettings.from_env(s.to_env()) == s


def test_values_below_what_works_fall_back_with_a_warning(caplog: object) -> None:
    import logging

    import pytest

    assert isinstance(caplog, pytest.LogCaptureFixture)
    caplog.set_level(logging.WARNING)
    # a socket buffer smaller than one batch frame would drop every batch
    s = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_BUFFER_BYTES": "65536", "GPUFOOTPRINT_PROBE_RAW_BUFFERS": "1",
                                "GPUFOOTPRINT_PROBE_DELIVERY": "fast", "GPUFOOTPRINT_PROBE_CUPTI_BUFFER_BYTES": "8192"})
    assert (s.buffer_bytes, s.raw_buffers, s.delivery) == (16 << 20, 256, "raw")
    assert s.cupti_buffer_bytes == 8192
    text = caplog.text
    assert "GPUFOOTPRINT_PROBE_BUFFER_BYTES='65536' is not valid" in text
    assert "GPUFOOTPRINT_PROBE_RAW_BUFFERS='1'" in text and "GPUFOOTPRINT_PROBE_DELIVERY='fast'" in text


def test_driver_hooks_default_on_and_a_bad_per_thread_value_falls_back(caplog: object) -> None:
    import logging

    import pytest

    assert isinstance(caplog, pytest.LogCaptureFixture)
    caplog.set_level(logging.WARNING)
    assert ProbeSettings().driver_hooks is True
    s = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_DRIVER_HOOKS": "0", "GPUFOOTPRINT_PROBE_PER_THREAD_BUFFER": "maybe"})
    assert s.driver_hooks is False and s.per_thread_buffer == "cupti"
    assert "GPUFOOTPRINT_PROBE_PER_THREAD_BUFFER='maybe' is not one of" in caplog.text
    assert ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_PER_THREAD_BUFFER": "off"}).per_thread_buffer == "off"
