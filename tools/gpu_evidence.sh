#!/usr/bin/env bash
# One GPU session's evidence: environment, the CUDA tests, and the offload benchmark table.
# Usage: OUT=/some/dir bash tools/gpu_evidence.sh   (writes logs and the JSON report under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/oled-evidence}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OLED_HOME=/tmp/oled-home
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/kernels tests/offload/test_gpu.py tests/decoding > "$OUT/gpu_tests.txt" 2>&1
tail -5 "$OUT/gpu_tests.txt"
python3 tools/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
python3 tools/bench_offload.py --model /tmp/oled-mini-shape --report-dir "$OUT" \
  --trace "$OUT/mini-shape.oledtrace" \
  "$@" 2>&1 | tee "$OUT/bench_offload.txt"
