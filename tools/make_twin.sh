#!/usr/bin/env bash
# Train the routing twin and record its traces (docs/routing-twin.md).
#   bash tools/make_twin.sh RUN_DIR [MINUTES] [TRACE_DIR]
# RUN_DIR receives the checkpoint, train.log, history.json and train_config.json; the tuning and
# held-out traces go to TRACE_DIR (default recipes/twin). Needs a CUDA GPU (one H200: MINUTES of
# training, default 20, then about a minute of recording). Training data: $OLED_TRAIN_DATA
# (default ~/.cache/oled/train-data, fetched with pip on first use).
set -euo pipefail
run=${1:?usage: make_twin.sh RUN_DIR [MINUTES] [TRACE_DIR]}
minutes=${2:-20}
traces=${3:-recipes/twin}
here=$(cd "$(dirname "$0")/.." && pwd)
python3 "$here/tools/train_default.py" --preset twin --device cuda --minutes "$minutes" \
    --cache "${OLED_TRAIN_DATA:-~/.cache/oled/train-data}" --out "$run"
for split in tune heldout; do
    python3 -m oled.cli trace record "$here/recipes/twin/record.toml" \
        -o "$traces/twin-$split.oledtrace" --set model.path="$(realpath "$run")/checkpoint" \
        --set workload.prompts="$here/recipes/twin/prompts-$split.jsonl"
done
