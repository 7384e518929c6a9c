"""verl backend: ``backend=verl`` cells (backend.py) launched after checks (launch.py), with a hook
in verl's Megatron actor that replays per-(token, layer) masks: selection.py chooses them,
patch.py enters verl, counters.py counts each route once across ranks, metrics.py reports the
step's keys and hook.py holds the state between them.

Importing this package does not import verl; ``hook`` and ``worker`` import it only when verl's
Megatron engine is built.
"""

from ablate.backends.verl.launch import VerlLaunchError, check_cell_config, check_verl, verl_overrides

__all__ = ["VerlLaunchError", "check_cell_config", "check_verl", "verl_overrides"]
