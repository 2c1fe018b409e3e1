#!/usr/bin/env bash
# Drain a folder of shards: for k = MIN_INDEX .. MAX_INDEX run QUERY_DIR/request_k.jsonl, one launch
# per shard, skipping missing shards. The runner publishes an output only when it is complete and
# checks an existing one before it loads anything: written with the same model and settings, the
# shard is skipped (counted as skipped); written by another run, the shard fails with a message
# naming the difference (--overwrite recomputes, OUTPUT_DIR writes elsewhere). An interrupted shard
# left a journal and resumes where it stopped. Rerun the same command after a crash or preemption.
#
# Usage:
#   [MODEL=DIR] [QUERY_DIR=DIR] [MAX_INDEX=K] [NPROC=N] launch/drain.sh [runner flags...]
# Example (shards from `python split_queries.py --input-file helm.jsonl --output-dir queries --requests-per-shard 500`):
#   MODEL=/models/llama-2-70b-hf QUERY_DIR=queries/default MAX_INDEX=199 NPROC=8 launch/drain.sh --budget 32768
#   MODEL=meta-llama/Llama-3.1-70B NPROC=8 launch/drain.sh --revision main   (a hub id: cache first, fetched once)
#
# Environment (defaults in brackets):
#   MODEL        HuggingFace folder or hub id               [empty: the runner's embedded default model]
#   QUERY_DIR    folder of request_<k>.jsonl shards (DATA is accepted as an alias)  [queries/default]
#   MIN_INDEX    first shard index                          [0]
#   MAX_INDEX    last shard index, inclusive                 [99]
#   NPROC        ranks per shard: >1 = torchrun --standalone, 1 = a single python process  [1]
#   OUTPUT_DIR   where output_request_<k>.jsonl go          [empty: beside the shards, in QUERY_DIR]
#   KEEP_GOING   1 = go on after a failed shard (exit 1 at the end); 0 = stop at the first failure  [1]
#   TORCHRUN     launcher command for NPROC>1, split on spaces  [torchrun]
#   PYTHON       interpreter for NPROC=1                     [python]
#   REPO         checkout holding dist_inference_runner.py  [this script's parent folder]
#   STATUS_EVERY seconds between status lines of the running shard (its <output>.status.json); 0 = only
#                the line at its end  [60]
# Any further arguments go to every run unchanged.
set -euo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0; }

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
MODEL=${MODEL:-}
QUERY_DIR=${QUERY_DIR:-${DATA:-queries/default}}
MIN_INDEX=${MIN_INDEX:-0}
MAX_INDEX=${MAX_INDEX:-99}
NPROC=${NPROC:-1}
OUTPUT_DIR=${OUTPUT_DIR:-}
KEEP_GOING=${KEEP_GOING:-1}
PYTHON=${PYTHON:-python}
STATUS_EVERY=${STATUS_EVERY:-60}
read -r -a TORCHRUN_CMD <<< "${TORCHRUN:-torchrun}"

if [[ ! -d $QUERY_DIR ]]; then
    echo "drain: QUERY_DIR=$QUERY_DIR is not a folder" >&2
    exit 2
fi
[[ -n $OUTPUT_DIR ]] && mkdir -p "$OUTPUT_DIR"
model_args=()
[[ -n $MODEL ]] && model_args=(--model-name "$MODEL")
if ((NPROC > 1)); then
    launch=("${TORCHRUN_CMD[@]}" --standalone --nproc-per-node "$NPROC" "$REPO/dist_inference_runner.py")
else
    launch=("$PYTHON" "$REPO/dist_inference_runner.py")
fi

stop=0 child=
# shellcheck disable=SC2329 # invoked by the traps below
on_signal() {  # SIGTERM to the running shard (a background job ignores SIGINT), which stops and journals; none: exit
    stop=$1
    [[ -n $child ]] || { echo "drain: stopped" >&2; exit "$stop"; }
    kill -TERM "$child" 2>/dev/null || true
}
trap 'on_signal 130' SIGINT
trap 'on_signal 143' SIGTERM
ran=0 skipped=0 missing=0 failed=0
for ((k = MIN_INDEX; k <= MAX_INDEX; k++)); do
    input="$QUERY_DIR/request_$k.jsonl"
    output="${OUTPUT_DIR:-$QUERY_DIR}/output_request_$k.jsonl"
    if [[ ! -f $input ]]; then
        missing=$((missing + 1))
        continue
    fi
    existed=0
    [[ -e $output && " $* " != *" --overwrite "* ]] && existed=1
    if ((existed)); then
        echo "drain: check $input: $output exists" >&2
    else
        echo "drain: run $input -> $output" >&2
    fi
    rc=0 watcher=
    status="$output.status.json"  # the runner's default status file (docs/usage/monitoring.md)
    if ((STATUS_EVERY > 0)); then
        PYTHON=$PYTHON "$REPO/launch/status_watch.sh" "$status" "$STATUS_EVERY" "$$" </dev/null &
        watcher=$!
    fi
    "${launch[@]}" ${model_args[@]+"${model_args[@]}"} --infer-data "$input" --output-path "$output" "$@" &
    child=$!  # in the background: a signal to this script alone interrupts wait, and its trap passes it on
    wait "$child" || rc=$?
    while ((stop)) && kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done
    child=
    if [[ -n $watcher ]]; then  # (killed before its trap is set, it ends with 143: not this shard's status)
        kill "$watcher" 2>/dev/null || true
        wait "$watcher" 2>/dev/null || true
    fi
    if ((! existed)) && [[ -f $status ]]; then
        echo "drain: status: $(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tasks.status "$status")" >&2 || true
    fi
    if ((stop || rc == 130 || rc == 143)); then
        echo "drain: $input interrupted (status $rc); rerun to resume" >&2
        exit $((stop ? stop : rc))
    elif ((rc != 0)); then
        echo "drain: $input failed with status $rc" >&2
        failed=$((failed + 1))
        ((KEEP_GOING == 1)) || break
    elif ((existed)); then
        echo "drain: skip $input: $output is complete (same model and settings)" >&2
        skipped=$((skipped + 1))
    else
        ran=$((ran + 1))
    fi
done
echo "drain: shards $MIN_INDEX..$MAX_INDEX of $QUERY_DIR: $ran ran, $skipped skipped (output complete), $missing missing, $failed failed" >&2
((failed == 0))
