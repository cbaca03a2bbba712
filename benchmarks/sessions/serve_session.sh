#!/usr/bin/env bash
# One GPU-machine call of the serving benchmark: set up, then benchmarks/serving/serve.py.
#
#   bash benchmarks/sessions/serve_session.sh NAME [serve.py arguments...]
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
# Carried (git-ignored, named in the call's `carry`):
#   .whl/       the wheels the machine's image lacks (redis, pydantic, starlette, uvicorn, ...),
#               installed to /tmp/site;
#   .redisbin/  this machine's Debian redis-server with the shared libraries the image lacks,
#               started through .redisbin/run-redis (LD_LIBRARY_PATH for redis-server alone).
#   TESTS="..." (optional): pytest those first (the GPU tests), into $OUT/NAME-tests.xml.
#   .tools/py-spy (optional): with PROFILE_S=N set, the worker is sampled for N seconds from
#               the start of the first measured run, into $OUT/NAME-worker.raw (py-spy's
#               collapsed stacks, every thread, GIL waits included).
# Results: $OUT/NAME.json, $OUT/NAME.png, the processes' logs as $OUT/NAME-logs.tgz, and
# everything printed in $OUT/session.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
name=${1:?a name for this run}
shift
exec > >(tee -a "$OUT/session.log") 2>&1

source benchmarks/sessions/device_session_env.sh
echo "cores: $(nproc); $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
.redisbin/run-redis --version || exit 1
python3 -c "import redis, hiredis, pydantic, pydantic_settings, starlette, uvicorn, websockets, \
httptools, gguf, tidegate.commands.cli, tidegate.worker.service.service, tidegate.producer.api, tidegate.streaming.gateway" || exit 1

if [[ -n "${TESTS:-}" ]]; then  # GPU tests first (TESTS="tests/gpu ..."), two minutes at most
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=append" -W default $TESTS \
    --junitxml="$OUT/$name-tests.xml" 2>&1 | tail -25
fi

logs=/tmp/serve-logs-$name
rm -rf "$logs"
if [[ -n "${PROFILE_S:-}" && -x .tools/py-spy ]]; then
  (  # once a worker runs and the log says a measured run began, sample it
    until grep -qE "^(burst|rate [0-9.]+/s): [0-9]+ jobs" "$OUT/session.log" 2>/dev/null; do
      sleep 0.5; done
    pid=$(pgrep -f "tidegate worker" | head -1)
    [[ -n "$pid" ]] && .tools/py-spy record --pid "$pid" --duration "$PROFILE_S" --rate 200 \
      --format raw --nonblocking --output "$OUT/$name-worker.raw" >/dev/null 2>&1
  ) &
fi
# Whatever is left of this run's budget (the call's 10 minutes by default, less a margin for
# packing and the copy back; SESSION_BUDGET_S when a call chains several runs).
timeout $(( ${SESSION_BUDGET_S:-570} - SECONDS )) python3 -m tidegate.benchmarks.serving.serve --redis-server "$PWD/.redisbin/run-redis" \
  --logdir "$logs" --out "$OUT/$name.json" --plot "$OUT/$name.png" "$@"
status=$?
tar czf "$OUT/$name-logs.tgz" -C "$logs" . 2>/dev/null
exit $status
