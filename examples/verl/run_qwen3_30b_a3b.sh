#!/usr/bin/env bash
# One ablation cell of Qwen3-30B-A3B on one 8xH100/H200 node (untested in CI: needs GPUs).
# Usage: bash examples/verl/run_qwen3_30b_a3b.sh POLICY BUDGET SEED [extra hydra overrides...]
#   POLICY: none | full | random | uniform | fisher | mismatch; BUDGET is ignored for none/full.
set -euo pipefail
POLICY="${1:?policy}"; BUDGET="${2:?budget}"; SEED="${3:?seed}"; shift 3
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python - "$POLICY" "$BUDGET" "$SEED" "$HERE" "$@" <<'PY'
import sys
from ablate.backends.verl import launch
policy, budget, seed, here, *extra = sys.argv[1:]
launch(policy, None if policy in ("none", "full") else float(budget), int(seed), {}, extra, config_dir=here)
PY
