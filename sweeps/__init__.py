"""Sweep definitions of the ablate app, shipped as the package ``ablate.sweeps``.

Hydra serves them as the config group ``sweeps`` (``python -m ablate sweeps=smoke``) through
``hydra_plugins/ablate_sweeps``; each file's header gives the command that runs it.
"""
