#!/bin/bash
SRC=$1; OUT=$2; MOD=$3
export PYTHONPATH=$SRC
/work/main/.venv/bin/python -c "import sys; from $MOD import main; sys.exit(main(sys.argv[1:]))" bench --backend llamacpp --threads 2 --categories humaneval,coding --prompts-per-category 2 --max-new-tokens 128 --methods target,prompt_lookup --no-progress --out $OUT
