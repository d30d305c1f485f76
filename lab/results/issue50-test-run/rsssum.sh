#!/bin/bash
# sample the summed RSS (GB) of pytest and its descendants every 2 s until $1 exists
root=$2; max=0
while [ ! -e "$1" ]; do
  pids=$(pstree -pT $root 2>/dev/null | grep -o '([0-9]\+)' | tr -d '()')
  s=0; for p in $pids; do r=$(awk '/VmRSS/{print $2}' /proc/$p/status 2>/dev/null); s=$((s+${r:-0})); done
  [ $s -gt $max ] && max=$s && echo "$(date +%T) $max" >> /tmp/prof/rsssum.txt
  sleep 2
done
