#!/bin/bash
set -x
WT=/work/wt-ct
cd /work/main && git worktree add -f $WT f1ce8f4 >/dev/null 2>&1
cd $WT
source /work/main/.venv/bin/activate
export PYTHONPATH=$WT/src HF_HUB_OFFLINE=1
lscpu | grep 'Model name'
for mode in no-exact exact; do
  /usr/bin/time -f "%e s" specdecode cost-table --backend llamacpp --$mode --out docs/results/cost-table-epyc/table-$mode.json --reps 5
  /usr/bin/time -f "%e s" specdecode bench --backend llamacpp --$mode --categories coding,humaneval --prompts-per-category 5 \
     --max-new-tokens 128 --methods target,prompt_lookup,suffix,draft_model --out docs/results/cost-table-epyc/bench-$mode \
     --cost-table docs/results/cost-table-epyc/table-$mode.json --no-progress
done
echo DONE
