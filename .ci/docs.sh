#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) in strict mode: a broken link or anchor, a nav
# entry without a page, or a page the nav leaves out fails the build. Its own venv (.venv-docs),
# so the docs toolchain never meets the project's dependencies; the versions are pinned.
set -euo pipefail
export NO_MKDOCS_2_WARNING=1   # the theme's end-of-life banner, not a build problem
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${DOCS_VENV:-.venv-docs}
MKDOCS_SPEC=("mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11")

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${MKDOCS_SPEC[@]}"
"$VENV/bin/python" -m mkdocs build --strict --clean
