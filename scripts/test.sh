#!/usr/bin/env bash
# Install pathgate with its dev tools into .venv (CPU build of torch), then lint, type-check and
# run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The pinned torch is a CPU build; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0 -e '.[dev,github]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
