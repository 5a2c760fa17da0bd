"""Out-of-memory capture: recent records per process, captures, and their listing."""
