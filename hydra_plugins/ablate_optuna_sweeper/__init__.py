"""A Hydra sweeper that tunes ablate cells with Optuna's ask-and-tell interface (``hydra/sweeper=ablate_optuna``).

Hydra finds it by scanning the ``hydra_plugins`` namespace package; ``config.py`` registers the
config and ``optuna_sweeper.py`` the plugin class. Optuna itself is imported only when a sweep
starts (``_impl.py``: Hydra skips modules whose name starts with ``_`` while scanning), so a plain
``python -m ablate`` run does not pay for it.
"""
