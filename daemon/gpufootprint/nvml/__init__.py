"""The NVML source: a small protocol (``client.NvmlClient``), the real pynvml client, and the poller."""
