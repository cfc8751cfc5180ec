#!/usr/bin/env bash
# Train the routing twin and record its traces (docs/routing-twin.md).
#   bash tools/make_twin.sh RUN_DIR [STEPS] [TRACE_DIR]
# RUN_DIR receives the checkpoint, train.log, history.json, train_config.json and state.pt; the
# traces go to TRACE_DIR (default recipes/twin). Needs a CUDA GPU (one H200: about 0.2 s a step,
# STEPS default 3700, then about two minutes of recording). Training resumes from RUN_DIR's
# state.pt: with STOP_MINUTES=M in the environment it stops after M minutes, and the same command
# goes on from there; FAST_THRESHOLD=T records the fast pace at T without searching (the one
# chosen before, in pace.json). Training data: $OLED_TRAIN_DATA (default
# ~/.cache/oled/train-data, fetched with pip on first use).
set -euo pipefail
run=${1:?usage: make_twin.sh RUN_DIR [STEPS] [TRACE_DIR]}
steps=${2:-3700}
traces=${3:-recipes/twin}
here=$(cd "$(dirname "$0")/.." && pwd)
python3 "$here/tools/train_default.py" --preset twin --device cuda --minutes 0 \
    --max-steps "$steps" --resume --stop-minutes "${STOP_MINUTES:-0}" --save-every-minutes 1000 \
    --cache "${OLED_TRAIN_DATA:-~/.cache/oled/train-data}" --out "$run"
if ! grep -q '"final"' "$run/train_config.json"; then
    echo "training stopped before step $steps: run the same command again to go on"
    exit 0
fi
python3 "$here/tools/record_twin.py" "$run/checkpoint" --out "$traces" \
    ${FAST_THRESHOLD:+--fast-threshold "$FAST_THRESHOLD"}
