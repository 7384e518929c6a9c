"""verl's real ``main_ppo`` on a CPU: a check of a verl config and of ablate's hook before GPU time.

``backend=verl_cpu`` runs verl 0.9.1's trainer, Ray, the Megatron or VeOmni engine with R3 on gloo
and the worker hook exactly as on a GPU, with stand-ins only where verl, mbridge and megatron-core
need CUDA (docs/verl-cpu.md lists each one and what it leaves unexercised):

- :mod:`.plugin`, imported by verl itself in every verl process (``VERL_USE_EXTERNAL_MODULES``):
  the CPU platform (:mod:`.platform`), the counted runtime patches (:mod:`.patches`) and the
  CPU rollout (:mod:`.rollout`);
- :mod:`.rollout`: a transformers rollout server that records the experts its own forward chose,
  with noise on its router logits so that its routes disagree with the trainer's;
- :mod:`.assets`: a tiny random Qwen3-MoE, a word-level tokenizer and a generated prompt set,
  made locally (nothing from a hub); :mod:`.reward`: the rule reward;
- :mod:`.launch`: the environment and overrides a cell's ``main_ppo`` runs with.

Importing this package imports neither verl nor torch.
"""

#: The rollout name the CPU rollout registers in verl (``actor_rollout_ref.rollout.name``).
ROLLOUT_NAME = "ablate_cpu"
#: The module verl imports in each of its processes (``VERL_USE_EXTERNAL_MODULES``).
PLUGIN_MODULE = "ablate.backends.verl.cpu.plugin"
#: Standard deviation of the noise the CPU rollout adds to its router logits (logit units).
ROUTER_NOISE_ENV = "ABLATE_VERL_CPU_ROUTER_NOISE"
#: The training engine of the cell (``backend.engine``): the plugin applies that engine's stand-ins.
ENGINE_ENV = "ABLATE_VERL_CPU_ENGINE"
