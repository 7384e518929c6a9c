#!/usr/bin/env bash
# Headless Chromium for tests/test_analysis_report.py (the HTML report opened offline, its images
# checked and a screenshot taken). Debian package `chromium`; installing needs root. Without it
# that test is skipped, so run this before `make test` in CI.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
