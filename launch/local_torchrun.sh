#!/usr/bin/env bash
# Single-node pipeline run: torchrun starts NPROC ranks of dist_inference_runner.py on this machine
# (one per GPU, or a share of the CPU cores), one pipeline stage each.
#
# Usage:
#   [MODEL=DIR] [DATA=FILE|DIR|'GLOB'] [NPROC=N] [OUTPUT=PATH] launch/local_torchrun.sh [runner flags...]
# Example:
#   MODEL=/models/llama-2-13b-hf DATA=queries/default NPROC=4 launch/local_torchrun.sh --budget 16384
#
# Environment (defaults in brackets):
#   MODEL        HuggingFace folder or hub id               [empty: the runner's embedded default model]
#   DATA         request file, directory of *.jsonl or a quoted glob  [examples/requests.jsonl]
#   NPROC        ranks = pipeline stages on this node      [visible GPUs per nvidia-smi, else 1]
#   OUTPUT       --output-path: a file (one input) or a directory (several)  [empty: output_<name> beside each input]
#   MASTER_ADDR, MASTER_PORT  explicit rendezvous          [empty: torchrun --standalone picks a free port]
#   TORCHRUN     launcher command, split on spaces          [torchrun]
#   REPO         checkout holding dist_inference_runner.py  [this script's parent folder]
# Any further arguments go to dist_inference_runner.py unchanged (see its --help).
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
MODEL=${MODEL:-}
DATA=${DATA:-$REPO/examples/requests.jsonl}
OUTPUT=${OUTPUT:-}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-}
read -r -a TORCHRUN_CMD <<< "${TORCHRUN:-torchrun}"

detect_gpus() {
    local n=0
    if command -v nvidia-smi > /dev/null 2>&1; then
        n=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
    fi
    echo "${n:-0}"
}
if [[ -z ${NPROC:-} ]]; then
    NPROC=$(detect_gpus)
    ((NPROC > 0)) || NPROC=1
fi

if [[ -n $MASTER_PORT ]]; then
    rdzv=(--nnodes 1 --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$MASTER_PORT")
else
    rdzv=(--standalone)
fi
args=(--infer-data "$DATA")
[[ -n $MODEL ]] && args+=(--model-name "$MODEL")
[[ -n $OUTPUT ]] && args+=(--output-path "$OUTPUT")

cmd=("${TORCHRUN_CMD[@]}" "${rdzv[@]}" --nproc-per-node "$NPROC" "$REPO/dist_inference_runner.py" "${args[@]}" "$@")
echo "local_torchrun: ${cmd[*]}" >&2
exec "${cmd[@]}"
