#!/usr/bin/env bash
# One GPU-machine call for speculative decoding: set up as gpu_session.sh does (the wheels in
# .whl/, the default model's parts in .gm1/ and .gm2/), then
#   bash benchmarks/sessions/speculative_session.sh bench   the H200 figures: speculative_gpu.py
#   bash benchmarks/sessions/speculative_session.sh tests   the GPU tests of speculation (the default
#                                                  model, both parts carried by then)
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
source benchmarks/sessions/device_session_env.sh
join_default_model
case ${1:-bench} in
  bench)
    timeout $(( 570 - SECONDS )) python3 -m tidegate.benchmarks.engine.speculative_gpu \
      --out "$OUT/speculative_gpu.json" ;;
  tests)
    timeout $(( 570 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" \
      -W default tests/gpu/test_gpu_speculative.py --junitxml="$OUT/gpu-spec-tests.xml" \
      2>&1 | tail -30 ;;
esac
