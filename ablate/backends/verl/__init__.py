"""verl backend: R3 with per-(token, layer) replay masks (hook.py), verl launch checks (launch.py)
and ``backend=verl`` cells (backend.py).

Importing this package does not import verl; ``hook`` and ``worker`` do.
"""

from ablate.backends.verl.launch import VerlLaunchError, check_cell_config, check_verl, verl_overrides

__all__ = ["VerlLaunchError", "check_cell_config", "check_verl", "verl_overrides"]
