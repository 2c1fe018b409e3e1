#!/usr/bin/env bash
# Print a run's status file (see docs/usage/monitoring.md) every EVERY seconds until the run is
# finished, failed or stale (its writing rank gone); used in the background by drain.sh and the
# Slurm/LSF recipes, whose job log then shows where a long job is.
#
# Usage: launch/status_watch.sh STATUS_FILE [EVERY=60]
#        launch/status_watch.sh --path INPUT [OUTPUT]   # prints the default status path of a one-file run
set -uo pipefail
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PYTHON=${PYTHON:-python}
if [[ ${1:-} == --path ]]; then  # the runner's default: <output>.status.json, output_<name> beside the input
    input=${2:?an input file}
    output=${3:-$(dirname "$input")/output_$(basename "$input")}
    echo "$output.status.json"
    exit 0
fi
file=${1:?usage: status_watch.sh STATUS_FILE [EVERY]}
every=${2:-60}
while sleep "$every"; do
    [[ -f $file ]] || continue
    line=$(cd "$REPO" && "$PYTHON" -m tasks.status "$file")
    rc=$?
    echo "status: $line" >&2
    ((rc == 3)) || exit 0  # finished (0) or failed / stale (1): nothing more to watch
done
