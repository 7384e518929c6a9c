"""What a verl worker needs to replay one cell: its :class:`~ablate.replay.ReplaySpec`, its engine and epochs.

The launch puts it into Ray's ``runtime_env`` as one JSON environment variable
(:func:`ablate.backends.verl.launch.verl_overrides`); the worker module reads it back in every
process of verl's run and builds the hook from it when verl builds the engine's R3 actor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ablate.replay.spec import ReplaySpec


@dataclass(frozen=True)
class HookSettings:
    """One cell's replay in verl's workers.

    ``update_epochs`` is the run's ``actor.ppo_epochs``: each update epoch counts every route once.
    ``engine`` is the training engine whose seam the hook installs in (``backend.engine``).
    """

    ENV = "ABLATE_VERL_CELL"

    replay: ReplaySpec
    engine: str = "megatron"
    update_epochs: int = 1

    @property
    def seed(self) -> int:
        return self.replay.seed

    def to_json(self) -> str:
        return json.dumps({"replay": json.loads(self.replay.to_json()), "engine": self.engine,
                           "update_epochs": self.update_epochs}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HookSettings:
        fields = json.loads(text)
        return cls(ReplaySpec.from_json(json.dumps(fields["replay"])), fields["engine"], fields["update_epochs"])

    @classmethod
    def from_env(cls) -> HookSettings | None:
        text = os.environ.get(cls.ENV)
        return None if text is None else cls.from_json(text)

    def make_hook(self):
        """The :class:`~ablate.replay.hook.ReplayMaskHook` of this cell in this engine."""
        from ablate.backends.verl import engines
        from ablate.replay.hook import ReplayMaskHook

        return ReplayMaskHook(self.replay, engines.seam_class(self.engine), update_epochs=self.update_epochs)
