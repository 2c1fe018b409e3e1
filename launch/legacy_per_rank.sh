#!/usr/bin/env bash
# The seed's launch: one background `python dist_inference_runner.py --rank i ...` per pipeline stage,
# rendezvous over tcp://MASTER_ADDR:PORT; Ctrl-C or SIGTERM stops every rank; the exit status is
# non-zero if any rank failed. Prefer launch/local_torchrun.sh; this is for hosts without torchrun
# or for per-rank control (CUDA device per rank, per-rank logs).
#
# Usage:
#   [MODEL=DIR] [DATA=FILE|DIR|'GLOB'] [NPROC=P] [PORT=N] launch/legacy_per_rank.sh [runner flags...]
# Example:
#   MODEL=/models/opt-66b DATA=queries/default/request_0.jsonl NPROC=8 launch/legacy_per_rank.sh --fp16
# Two nodes (run on each, NODE_RANK 0 and 1, MASTER_ADDR = node 0's address):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 DATA=requests.jsonl launch/legacy_per_rank.sh
#
# Environment (defaults in brackets):
#   MODEL        HuggingFace folder or hub id               [empty: the runner's embedded default model]
#   DATA         request file, directory of *.jsonl or a quoted glob  [examples/requests.jsonl]
#   NPROC        ranks started on this node (P)            [2]
#   NNODES       nodes taking part; world size = NNODES x NPROC, all of them one pipeline  [1]
#   NODE_RANK    this node's index; its ranks are NODE_RANK*NPROC .. +NPROC-1  [0]
#   MASTER_ADDR  host of rank 0                             [127.0.0.1]
#   PORT         rendezvous port on MASTER_ADDR             [29500]
#   OUTPUT       --output-path                              [empty: output_<name> beside each input]
#   LOG_DIR      if set, rank i's stdout+stderr go to LOG_DIR/rank_i.log  [empty: this terminal]
#   KILL_GRACE   seconds ranks get after SIGTERM before SIGKILL  [10]
#   PYTHON       interpreter                                [python]
#   REPO         checkout holding dist_inference_runner.py  [this script's parent folder]
# Any further arguments go to every rank unchanged.
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
MODEL=${MODEL:-}
DATA=${DATA:-$REPO/examples/requests.jsonl}
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
PORT=${PORT:-29500}
OUTPUT=${OUTPUT:-}
LOG_DIR=${LOG_DIR:-}
KILL_GRACE=${KILL_GRACE:-10}
PYTHON=${PYTHON:-python}

WORLD=$((NNODES * NPROC))
args=(--infer-data "$DATA")
[[ -n $MODEL ]] && args+=(--model-name "$MODEL")
[[ -n $OUTPUT ]] && args+=(--output-path "$OUTPUT")
[[ -n $LOG_DIR ]] && mkdir -p "$LOG_DIR"

pids=()
# every rank exits when this script is gone, even after kill -9 of it (the runner's comm/lifeline.py)
export DIST_INFER_LAUNCHER_PID=$$
# shellcheck disable=SC2329 # invoked by the trap below
stop_ranks() {
    local code=$1  # 128 + the signal's number: 130 for SIGINT, 143 for SIGTERM
    # The seed trapped with `kill 0`; that also kills whoever started this script when it runs
    # without job control (another script, a batch job), so only our own ranks are signalled.
    trap '' SIGINT SIGTERM
    echo "legacy_per_rank: interrupted, stopping ranks (pids ${pids[*]:-none})" >&2
    kill -TERM "${pids[@]}" 2> /dev/null || true
    local waited=0
    while ((waited < KILL_GRACE * 10)) && kill -0 "${pids[@]}" 2> /dev/null; do
        sleep 0.1
        waited=$((waited + 1))
    done
    kill -KILL "${pids[@]}" 2> /dev/null || true
    wait 2> /dev/null || true
    exit "$code"
}
trap 'stop_ranks 130' SIGINT
trap 'stop_ranks 143' SIGTERM

for ((i = 0; i < NPROC; i++)); do
    rank=$((NODE_RANK * NPROC + i))
    cmd=("$PYTHON" "$REPO/dist_inference_runner.py" "${args[@]}" "$@"
        --rank "$rank" --cuda-id "$i" --world-size "$WORLD" --pipeline-group-size "$WORLD"
        --dist-url "tcp://${MASTER_ADDR}:${PORT}")
    echo "legacy_per_rank: ${cmd[*]}" >&2
    if [[ -n $LOG_DIR ]]; then
        "${cmd[@]}" > "$LOG_DIR/rank_$rank.log" 2>&1 &
    else
        "${cmd[@]}" &
    fi
    pids+=($!)
done

status=0
for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if ((rc != 0)); then
        echo "legacy_per_rank: rank $((NODE_RANK * NPROC + i)) (pid ${pids[$i]}) exited with status $rc" >&2
        ((status != 0)) || status=$rc
    fi
done
exit "$status"
