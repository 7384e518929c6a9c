"""verl backend: ``backend=verl`` cells, declared in config.py (settings and the Backend object),
run by backend.py and launched after checks (launch.py), with a hook in verl's Megatron or VeOmni
actor that replays per-(token, layer) masks: selection.py chooses them, engines/ is the seam to
each training engine (every name it replaces is in entry_points.py), counters.py counts each
route once across ranks, metrics.py reports the step's keys and hook.py holds the state between
them.

Importing this package imports neither verl nor torch: composing a config imports config.py
only, and ``hook`` and ``worker`` import verl only when verl's training engine is built.
"""
