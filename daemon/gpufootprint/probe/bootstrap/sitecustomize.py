"""Put on PYTHONPATH by ``gpufootprint run``: start the probe in every Python child.

If another ``sitecustomize`` exists further down the path, it is run too, so the
user's own start-up code keeps working.
"""

import importlib.util
import os
import sys

try:
    from gpufootprint.probe import _autostart  # noqa: F401 - starts the probe when GPUFOOTPRINT_PROBE=1
except Exception:  # noqa: BLE001, S110 - the user's program must start even if the probe cannot
    pass


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_gpufootprint_user_sitecustomize", candidate)
            if spec and spec.loader:
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                except Exception:  # noqa: BLE001, S110 - as if no sitecustomize were there: the user's code runs on
                    pass
            return


_chain()
