#!/usr/bin/env bash
# One ablation cell of Qwen3-30B-A3B on one 8xH100/H200 node (untested in CI: needs GPUs).
# Usage: bash examples/verl/run_qwen3_30b_a3b.sh POLICY BUDGET SEED [verl overrides...]
#   POLICY: none | full | random | uniform | fisher | mismatch; BUDGET is ignored for none/full.
# The cell goes through ablate's own app, so it lands in the run store and W&B like any other.
set -euo pipefail
POLICY="${1:?policy}"; BUDGET="${2:?budget}"; SEED="${3:?seed}"; shift 3
case "$POLICY" in none|full) BUDGET_ARG=() ;; *) BUDGET_ARG=("budget=$BUDGET") ;; esac
OVERRIDES=""
for override in "$@"; do OVERRIDES="${OVERRIDES:+$OVERRIDES,}'$override'"; done
python -m ablate backend=verl "policy=$POLICY" "${BUDGET_ARG[@]}" "seed=$SEED" "backend.overrides=[$OVERRIDES]"
