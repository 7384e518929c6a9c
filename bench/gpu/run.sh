#!/usr/bin/env bash
# On the GPU machine (torch installed, no registry): install the carried wheels beside torch, then
# run the policy benchmark, the hook benchmark and the Megatron MoE step with verl's R3 and the
# hook, all on CUDA. Output goes to $OUT (or ./gpu-bench-out).
# Usage, from the repository root: bash bench/gpu/run.sh
# Prepared by bench/gpu/prepare.sh; not yet run on a GPU.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="$REPO/build/gpu-wheels"
OUT="${OUT:-$REPO/gpu-bench-out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
HAVE="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
WANT="$(cat "$WHEELS/PYTHON_VERSION")"
if [ "$HAVE" != "$WANT" ]; then
    echo "this machine runs Python $HAVE but build/gpu-wheels holds wheels for $WANT: run bench/gpu/prepare.sh $HAVE" >&2
    exit 2
fi
# Into a folder of their own on PYTHONPATH: the machine's torch and environment stay untouched, and
# --no-deps because the wheel list is the whole closure (no other torch can come in).
"$PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$OUT/site" "$WHEELS"/*.whl
export PYTHONPATH="$OUT/site:$REPO"
RUN=("$PYTHON")
"${RUN[@]}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/device.txt"
"${RUN[@]}" "$REPO/bench/bench_verl_hook.py" --device cuda 2>&1 | tee "$OUT/bench_verl_hook.txt"
if "${RUN[@]}" "$REPO/bench/bench_policies.py" --help | grep -q -- --device; then
    "${RUN[@]}" "$REPO/bench/bench_policies.py" --device cuda 2>&1 | tee "$OUT/bench_policies.txt"
else
    echo "bench/bench_policies.py has no --device option in this checkout: policy benchmark skipped" | tee "$OUT/bench_policies.txt"
fi
"${RUN[@]}" "$REPO/bench/gpu_verl_moe.py" --device cuda 2>&1 | tee "$OUT/gpu_verl_moe.txt"
