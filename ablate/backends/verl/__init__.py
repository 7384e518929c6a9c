"""verl backend: R3 with per-(token, layer) replay masks (see hook.py) and the cell launcher.

Importing this package does not import verl; ``hook`` and ``worker`` do.
"""

from ablate.backends.verl.launch import VerlLaunchError, check_cell_config, check_verl, launch, verl_overrides

__all__ = ["VerlLaunchError", "check_cell_config", "check_verl", "launch", "verl_overrides"]
