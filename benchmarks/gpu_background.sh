#!/usr/bin/env bash
# A device run longer than one call's 10 minutes (shared/device/README.md): a process started in
# its own session outlives the call that started it, and back-to-back calls keep the machine.
#   run(command="bash benchmarks/gpu_background.sh start 'CMD; CMD ...'")  starts; waits until 560 s
#   run(command="bash benchmarks/gpu_background.sh wait")                  waits until 560 s more
#   run(command="bash benchmarks/gpu_background.sh wait 300", timeout_s=340)  waits until 300 s: a
#     last call that fits what is left of the session's device time (it packs the results at 300 s)
# Send the start call and the wait calls in one message: they then run back to back. A wait sent
# after reading the start call's reply came too late once (2026-12-03: the machine had gone back
# in the gap, and the wait held a fresh one for 560 s); a wait that finds no run says so and
# ends at once.
# The commands run from a copy of this checkout in /root/bg/src in gpu_env.sh's environment, and write
# their results to /root/bg/out (given to them as $RESULTS); every call returns that folder as
# results.tgz in $OUT (`tar -xzf` it here), and the log.
set -uo pipefail
BG=/root/bg
what=$1; shift
# how long this call waits before it packs the results (the call ends at 600 s)
limit=560
[ "$what" = wait ] && [ $# -gt 0 ] && limit=$1
if [ "$what" = start ]; then
  source "$(dirname "$0")/gpu_env.sh" > /dev/null 2>&1
  rm -rf "$BG" && mkdir -p "$BG/out" && cp -r . "$BG/src"
  # the session inherits gpu_env.sh's exported environment: its installs run once
  cd "$BG/src" && RESULTS="$BG/out" setsid nohup bash -c "$1; echo \"exit \$?\" > $BG/done" \
    > "$BG/log" 2>&1 < /dev/null &
fi
if [ ! -d "$BG/out" ]; then
  echo "no run on this machine: it is a fresh one (the one that ran it went back)"; exit 3
fi
while [ ! -f "$BG/done" ] && [ "$SECONDS" -lt "$limit" ]; do sleep 5; done
# at most 8 files come back from a call (shared/device/README.md): the folder as one archive
tar -czf "${OUT:-/tmp}/results.tgz" -C "$BG/out" . 2>/dev/null
cp "$BG/log" "${OUT:-/tmp}/" 2>/dev/null
grep -E "^\[|^\||Error|error|exit" "$BG/log" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -40
[ -f "$BG/done" ] && cat "$BG/done" || echo "still running"
