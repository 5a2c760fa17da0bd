"""Feature frames per (pid, gpu) from exact event timestamps (frames.py)."""
