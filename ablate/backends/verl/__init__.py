"""verl backend: ``backend=verl`` cells, declared in config.py (settings, the one table of training
engines, the Backend object), run by backend.py and launched after checks (launch.py), with ablate's
replay hook (:mod:`ablate.replay.hook`, driving the cell's :class:`~ablate.replay.ReplaySession`) in
verl's Megatron or VeOmni actor: engines/ is the seam to each training engine (every name it replaces
is in entry_points.py), hook_settings.py carries the cell to verl's workers, offpolicy.py and
probe_passes.py are verl's metric path.

Importing this package imports neither verl nor torch: composing a config imports config.py
only, and ``worker`` imports verl only when verl's training engine is built.
"""
