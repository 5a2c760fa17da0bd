"""The adaptive sampler (state.py: one state machine per process) and the hub the pipeline feeds (hub.py)."""
