#!/bin/bash
# sample the summed RSS (kB) of process $1 and its descendants every 2 s while it lives; peaks to $2
root=$1; max=0
while kill -0 $root 2>/dev/null; do
  pids=$(pstree -pT $root 2>/dev/null | grep -o '([0-9]\+)' | tr -d '()')
  s=0; for p in $pids; do r=$(awk '/VmRSS/{print $2}' /proc/$p/status 2>/dev/null); s=$((s+${r:-0})); done
  [ $s -gt $max ] && max=$s && echo "$(date +%T) $max" >> $2
  sleep 2
done
