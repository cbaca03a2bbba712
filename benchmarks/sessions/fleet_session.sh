#!/usr/bin/env bash
# One device-machine call of the fleet benchmark (issue 24): the machine's 16 CPU cores run the
# fleet (Redis, APIs, gateways, random:tiny workers, clients); its GPU is not used.
#
#   bash benchmarks/sessions/fleet_session.sh NAME [fleet.py arguments...]
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
# Carried (git-ignored, named in the call's `carry`):
#   .whl/       the wheels the machine's image lacks, installed to /tmp/site;
#   .redisbin/  this machine's redis-server and redis-cli with their shared libraries and
#               dynamic loader (run-redis-server, run-redis-cli start them through it).
# Results: $OUT/NAME.json, the processes' logs as $OUT/NAME-logs.tgz, everything printed in
# $OUT/session.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
name=${1:?a name for this run}
shift
exec > >(tee -a "$OUT/session.log") 2>&1
source benchmarks/sessions/device_session_env.sh
echo "cores: $(nproc); $(python3 -c 'import torch; print("torch", torch.__version__)')"
.redisbin/run-redis-server --version || exit 1
python3 -c "import redis, hiredis, pydantic, starlette, uvicorn, websockets, arq, \
tidegate.commands.cli, tidegate.worker.service.service, tidegate.producer.api, tidegate.streaming.gateway" || exit 1
logs=/tmp/fleet-logs-$name
rm -rf "$logs"
timeout $(( ${SESSION_BUDGET_S:-570} - SECONDS )) python3 -m tidegate.benchmarks.cluster.fleet \
  --redis-server "$PWD/.redisbin/run-redis-server" --redis-cli "$PWD/.redisbin/run-redis-cli" \
  --logdir "$logs" --out "$OUT/$name.json" "$@"
status=$?
tar czf "$OUT/$name-logs.tgz" -C "$logs" . 2>/dev/null
exit $status
