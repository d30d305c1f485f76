#!/usr/bin/env bash
# Set up (idempotent) and run the main job: speculative decoding on the default pair
# (target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct), streaming, with stats.
# Extra arguments go to `specdecode generate` (e.g. --compare, --temperature 0.7, -k 6).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/specdecode generate \
  "Write a Python function that returns the longest palindromic substring of a string, with a short docstring." \
  --max-new-tokens 200 "$@"
