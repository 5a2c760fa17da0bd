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
