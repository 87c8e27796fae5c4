#!/usr/bin/env bash
# A device run longer than one call's 10 minutes (shared/device/README.md): a process started in
# its own session outlives the call that started it, and back-to-back calls keep the machine.
#   run(command="bash benchmarks/gpu_background.sh start 'CMD; CMD ...'")  starts; waits until 560 s
#   run(command="bash benchmarks/gpu_background.sh wait")                  waits until 560 s more
# The commands run from a copy of this checkout in /root/bg/src in gpu_env.sh's environment, and write
# their results to /root/bg/out (given to them as $RESULTS); every call returns that folder as
# results.tgz in $OUT (`tar -xzf` it here), and the log.
set -uo pipefail
BG=/root/bg
what=$1; shift
if [ "$what" = start ]; then
  source "$(dirname "$0")/gpu_env.sh" > /dev/null 2>&1
  rm -rf "$BG" && mkdir -p "$BG/out" && cp -r . "$BG/src"
  # the session inherits gpu_env.sh's exported environment: its installs run once
  cd "$BG/src" && RESULTS="$BG/out" setsid nohup bash -c "$1; echo \"exit \$?\" > $BG/done" \
    > "$BG/log" 2>&1 < /dev/null &
fi
while [ ! -f "$BG/done" ] && [ "$SECONDS" -lt 560 ]; do sleep 5; done  # the call ends at 600 s
# at most 8 files come back from a call (shared/device/README.md): the folder as one archive
tar -czf "${OUT:-/tmp}/results.tgz" -C "$BG/out" . 2>/dev/null
cp "$BG/log" "${OUT:-/tmp}/" 2>/dev/null
grep -E "^\[|^\||Error|error|exit" "$BG/log" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -40
[ -f "$BG/done" ] && cat "$BG/done" || echo "still running"
