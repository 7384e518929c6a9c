#!/usr/bin/env bash
# Build the separate verl test environment (.venv-verl) for tests/verl_tier and tests/verl_e2e.
# Idempotent: creates the venv only when missing and lets pip skip what is already installed.
# Usage: bash .ci/verl-env.sh && .venv-verl/bin/python -m pytest tests/verl_tier -q
#
# Order matters: torch goes in FIRST and pinned, so no later requirement lets pip choose a
# (multi-GB CUDA) torch build. verl is installed with --no-deps and without extras because
# its extras pin torch 2.11; its runtime needs are listed explicitly below.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$REPO/.venv-verl}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps verl==0.9.1
"${PIP[@]}" torch==2.13.0 megatron-core==0.16.1 tensordict==0.10.0 \
    "transformers>=5.5.3,<5.11,!=5.6.0" "omegaconf>=2.2,<2.4" "hydra-core>=1.3.2,<1.4" \
    codetiming cachetools fastapi uvicorn "ray>=2.30,<3" pytest numpy pandas pyarrow peft accelerate datasets dill pybind11 pylatexenc torchdata tensorboard
# What verl 0.9.1's main_ppo itself imports at run time (its verl-core and mcore extras, less the
# CUDA ones): the CPU end-to-end tier (tests/verl_e2e, backend=verl_cpu) runs the whole trainer.
"${PIP[@]}" torch==2.13.0 "TransferQueue==0.1.11" pyzmq msgspec aiohttp "mbridge==0.15.1" einops prometheus_client
# VeOmni, for backend.engine=veomni (verl's VeOmni engine, FSDP2), CPU-only and without its
# dependencies. verl 0.9.1's own extra (veomni-sft) pins veomni==0.1.11, whose Qwen3-MoE modeling
# was generated against transformers 5.2 and fails under the transformers verl 0.9.1 needs
# (create_causal_mask() got an unexpected keyword argument 'cache_position'); 0.1.12's, generated
# against transformers 5.9, runs. VeOmni's requirements would downgrade datasets to <=2.21 and its
# gpu extra is CUDA wheels (flash-attn, nccl): everything the engine imports of it is already here.
"${PIP[@]}" --no-deps veomni==0.1.12
# ablate itself, editable, plus the core runtime deps from pyproject.toml (torch is already pinned).
"${PIP[@]}" torch==2.13.0 "optuna>=4.0" "wandb>=0.31" "filelock>=3.12" "psutil>=5.9" "tqdm>=4.66" "cloudpickle>=2.2"
# The analysis extra: the CPU tier analyses the sweep it ran.
"${PIP[@]}" torch==2.13.0 "matplotlib>=3.8" "scipy>=1.15" "wandb-workspaces>=0.4.13,<0.5"
"${PIP[@]}" --no-deps -e "$REPO"
# The worked example policy package: the router-level tests run it beside the built-ins.
"${PIP[@]}" --no-deps -e "$REPO/examples/margin_policy"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "verl", "megatron-core", "veomni", "tensordict", "transformers", "mbridge", "TransferQueue"):
    print(f"{name}=={md.version(name)}")
PY
