#!/usr/bin/env bash
# Print a run's status file (see docs/usage/monitoring.md) every EVERY seconds until the run is
# finished, failed, stopped or stale (its writing rank gone), or until process PID (the run) has exited; used
# in the background by drain.sh and the Slurm/LSF recipes, whose job log then shows where a long job is.
#
# Usage: launch/status_watch.sh STATUS_FILE [EVERY=60] [PID]
#        launch/status_watch.sh --path INPUT [OUTPUT]   # prints the default status path of a one-file run
set -uo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0; }
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PYTHON=${PYTHON:-python}
if [[ ${1:-} == --path ]]; then  # the runner's default: <output>.status.json, output_<name> beside the input
    input=${2:?an input file}
    output=${3:-$(dirname "$input")/output_$(basename "$input")}
    echo "$output.status.json"
    exit 0
fi
file=${1:?usage: status_watch.sh STATUS_FILE [EVERY] [PID]}
every=${2:-60}
pid=${3:-}
trap 'exit 0' TERM INT
show() {  # one status line; returns the reader's code (0 finished, 1 failed/stopped/stale, 3 running)
    [[ -f $file ]] || return 3
    local line rc
    line=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tasks.status "$file")
    rc=$?
    echo "status: $line" >&2
    return $rc
}
alive() {  # the run's process exists and is not a zombie (its parent may reap it only after our pipes close)
    local state
    state=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
    [[ $state != Z* ]]
}
waited=0
while true; do
    sleep 1  # short naps: the watcher ends within a second of its run
    if [[ -n $pid ]] && ! alive; then
        exit 0
    fi
    waited=$((waited + 1))
    if ((waited >= every)); then
        waited=0
        show
        (($? == 3)) || exit 0  # finished or failed / stale: nothing more to watch
    fi
done
