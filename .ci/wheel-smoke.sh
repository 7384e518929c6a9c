#!/usr/bin/env bash
# The installed-package path a user takes: build the wheel, install it into a fresh virtual
# environment (CPU torch first), then from an empty directory with no checkout in sight run
# --help, one cell, a two-cell sweep and the analysis of that sweep.
#   bash .ci/wheel-smoke.sh            (make test-wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Built from a copy of the files a commit would hold, so no build/ folder lands in the checkout.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src"
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/ablate-*.whl)"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$TORCH_SPEC"
"$work/venv/bin/python" -m pip install --quiet "${wheel}[analysis]"

mkdir "$work/elsewhere"
cd "$work/elsewhere"
export WANDB_SILENT=true WANDB_DIR="$work/wandb-home" WANDB_CONFIG_DIR="$work/wandb-home" WANDB_CACHE_DIR="$work/wandb-home"
bin="$work/venv/bin"
tiny=(backend.steps=4 backend.layers=2 backend.experts=4 backend.d_model=16 backend.expert_hidden=16
      backend.prompts_per_step=4 backend.group_size=4 backend.digits=3)

echo "== ablate --help (installed, from $PWD)"
"$bin/ablate" --help > help.txt
grep -q "^backend: noop, synthetic, .*synthetic_async.*, verl, verl_cpu$" help.txt
grep -qx "policy: fisher, full, mismatch, none, random, threshold, uniform" help.txt
grep -q "^sweeps: .*budget_selection.*smoke" help.txt

echo "== one cell"
"$bin/ablate" policy=fisher budget=0.25 seed=0 "${tiny[@]}"
test -f runs/adhoc/fisher-b0.25-s0-*/records.parquet

echo "== a two-cell sweep"
"$bin/ablate" -m policy=none,random budget=0.25 seed=0 sweep=wheel "${tiny[@]}"
test "$(ls -d runs/wheel/*-s0-* | wc -l)" -eq 2

echo "== the analysis of that sweep"
"$bin/ablate-analyze" runs/wheel --reps 200 --no-plots
test -f runs/wheel/analysis/table_final_reward.csv
echo "wheel smoke: ok"
