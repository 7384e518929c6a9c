"""Test helpers shared by the test modules: the tiny synthetic cell and the real app config.

A module of its own, not ``conftest``: the verl tiers have a ``conftest`` of their own, and
``from conftest import ...`` would find whichever was imported first.
"""

from pathlib import Path

#: Overrides that shrink the synthetic backend to a cell of about a second.
TINY = [
    "backend.steps=6", "backend.layers=2", "backend.experts=4", "backend.topk=2", "backend.d_model=16",
    "backend.expert_hidden=16", "backend.prompts_per_step=4", "backend.group_size=4", "backend.digits=3",
    "backend.router_noise=0.05",
]


def compose_config(*overrides: str, store: Path | None = None, tiny: bool = True):
    """The real app config, composed with Hydra's compose API from the package's configs.

    ``tiny`` shrinks the synthetic backend (``TINY``); pass False for another backend.
    """
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        extra = [f"store_dir={store}"] if store is not None else []
        return compose("config", overrides=[*(TINY if tiny else []), *extra, *overrides])
