#!/usr/bin/env bash
# One GPU-machine call for the model families: their GPU tests, then offline 1000 x 256/256 and
# batch-1 decode for each family's real shape (random weights), Llama-3-8B beside them.
#
#   bash benchmarks/sessions/families_session.sh [tests|none] [model ...]
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set;
# carries .whl/ as benchmarks/sessions/gpu_session.sh does. Results: $OUT/families_<model>.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
source benchmarks/sessions/device_session_env.sh
what=${1:-tests}
shift || true
if [[ $what == tests ]]; then
  files=()
  for f in tests/gpu/test_gpu_families.py tests/kernels/reference/test_moe.py \
           tests/kernels/gpu/test_triton_family_attention.py tests/gpu/test_gpu_attention.py; do
    [[ -f $f ]] && files+=("$f")
  done
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default "${files[@]}" \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -30
fi
for model in "$@"; do
  left=$(( 570 - SECONDS ))
  (( left > 30 )) || { echo "no time left for $model"; break; }
  name=${model#random:}
  timeout $left python3 -m tidegate.benchmarks.engine.gpu_throughput --model "$model" \
    --only ${SECTIONS:-batch1 offline} --out "$OUT/families_$name.json" 2>&1 | tail -4
done
