"""One root exception; every error message says where (file:line, byte offset, key path)."""

from __future__ import annotations


class GpuFootprintError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code = 1


class ConfigError(GpuFootprintError):
    """An invalid configuration value; the message names the key path and value."""

    exit_code = 2


class TraceError(GpuFootprintError):
    """A damaged or unreadable trace; the message names the file and the place."""

    exit_code = 1


class FrameError(TraceError):
    """A frame that breaks the wire format; the message names the byte offset."""
