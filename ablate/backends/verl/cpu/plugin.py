"""Imported by verl in every one of its processes (``VERL_USE_EXTERNAL_MODULES``), at ``import verl``.

It registers the CPU platform (selected by ``VERL_PLATFORM=cpu``), applies the CPU patches and
registers the CPU rollout. verl imports it from inside its own ``__init__``, so it imports only
verl modules that do not need the package finished.
"""

from ablate.backends.verl.cpu import platform  # noqa: F401  (registers the platform)
from ablate.backends.verl.cpu.patches import apply_all
from ablate.backends.verl.cpu.rollout import register

apply_all()
register()
