# Sourced by the GPU-machine session scripts (lora_session.sh, structured_session.sh) once their
# output is being logged: the carried wheels (.whl/) installed to /tmp/site and put on
# PYTHONPATH (NO_WHEELS=1: a CPU rehearsal in the project's own environment), a kernel cache,
# enough file descriptors for the stack, and what the machine is.
if [[ -z ${NO_WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TIDEGATE_KERNEL_CACHE=/tmp/tidegate-kernels
ulimit -n 65536 2>/dev/null || ulimit -n 8192
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader \
  2>/dev/null || echo "no nvidia-smi"

status=0
# serve NAME SECONDS [more serve.py arguments]: one serve.py run with the caller's "${common[@]}"
# into $OUT/${RESULTS}_NAME.json, its logs kept in /tmp/logs/NAME; a failure is kept in $status.
serve() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: up to ${limit}s (at ${SECONDS}s of the call)"
  timeout "$limit" python3 benchmarks/serving/serve.py "${common[@]}" --logdir "/tmp/logs/$name" \
    --out "$OUT/${RESULTS}_$name.json" "$@" || status=$?
}
