#!/usr/bin/env bash
# Download the wheels bench/gpu/run.sh installs on a GPU machine that has torch and no registry.
# Run here (a registry is reachable), then carry build/gpu-wheels (ignored by git, about 40 MiB).
# Usage: bash bench/gpu/prepare.sh [PYTHON_VERSION, default: this python's, e.g. 3.11]
# The wheels are for CPython PYTHON_VERSION on Linux x86-64: run.sh checks the machine matches.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VERSION="${1:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
WHEELS="$REPO/build/gpu-wheels"
rm -rf "$WHEELS" && mkdir -p "$WHEELS"
"$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version "$VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" -r "$REPO/bench/gpu/requirements.txt"
echo "$VERSION" > "$WHEELS/PYTHON_VERSION"
du -sh "$WHEELS"
