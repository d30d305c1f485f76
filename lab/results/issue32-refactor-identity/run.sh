#!/bin/bash
# usage: run.sh SRC OUTPREFIX MAINMODULE
SRC=$1; OUT=$2; MOD=$3
export PYTHONPATH=$SRC
PY="/work/main/.venv/bin/python -c \"import sys; from $MOD import main; sys.exit(main(sys.argv[1:]))\""
run() { /work/main/.venv/bin/python -c "import sys; from $MOD import main; sys.exit(main(sys.argv[1:]))" "$@"; }
run bench --backend torch --categories coding,humaneval --prompts-per-category 1 --max-new-tokens 40 --no-warmup \
  --methods target,draft_model,prompt_lookup,eagle --no-progress --out $OUT-torch
run bench --backend torch --categories coding --prompts-per-category 1 --max-new-tokens 32 --temperature 0.8 --no-warmup \
  --methods target,draft_model --no-progress --out $OUT-torch-sampled
run bench --backend llamacpp --categories coding,humaneval,translation --prompts-per-category 1 --max-new-tokens 64 --no-warmup \
  --methods target,prompt_lookup,draft_model --no-progress --out $OUT-llamacpp
