#!/usr/bin/env bash
# Set up (idempotent), lint, and run every test, the slow real-model test included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests
# two workers: the real models' tests in one, in order, the tiny models' tests beside them (tests/conftest.py)
exec .venv/bin/pytest -q -n 2 "$@"
