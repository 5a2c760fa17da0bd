"""Decision engines: pure functions of an immutable snapshot and the config.

Each engine turns a ``PipelineSnapshot`` (and, where a trend or an accrual needs
history, a small state object fed by successive snapshots) into frozen decision
dataclasses. Nothing here does I/O or imports pynvml, cupti or prometheus_client
(a test scans the imports): the daemon sends the actions, logs the events and
exports the metrics.
"""
