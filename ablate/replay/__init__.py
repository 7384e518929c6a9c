"""The one replay core every backend drives (docs/design.md section 5).

- :class:`ReplaySpec`: what a cell replays (policy, budget, seed, probes), settled once where the
  cell is composed;
- :class:`ReplaySession`: one cell's replay over its steps, the masks it chooses and what it
  counts of them, on whichever device the routes are;
- :mod:`ablate.replay.calls` and :mod:`ablate.replay.seams`: a session driven micro-batch by
  micro-batch from inside a training engine (verl's Megatron and VeOmni engines);
- :mod:`ablate.replay.megatron_core`: a session inside any Megatron-core loop that replays through
  Megatron-core's own ``RouterReplay``.
"""

from ablate.replay.session import ReplaySession
from ablate.replay.spec import ReplaySpec

__all__ = ["ReplaySession", "ReplaySpec"]
