#!/usr/bin/env bash
# One GPU-machine call for LoRA adapters against the base model, on Llama-3-8B's shape (random
# bf16 weights) with 8 rank-16 adapters on every projection (random PEFT directories).
#
#   bash benchmarks/sessions/lora_session.sh offline [lora_throughput.py run arguments...]  # engine alone
#   bash benchmarks/sessions/lora_session.sh serve [serve.py arguments...]                  # whole stack
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
# Carried (git-ignored, named in the call's `carry`): .whl/ (the wheels the image lacks,
# installed to /tmp/site) and, for serve, .redisbin/ (redis-server and the shared libraries the
# image lacks, started through .redisbin/run-redis).
# Both modes first write the adapters to $ADAPTERS (default /tmp/lora-adapters; kept when a
# machine still warm from the last call has them) with lora_throughput.py write-adapters.
# offline: lora_throughput.py run (base, 8 adapters mixed, base again, one request alone
#   without and with an adapter), into $OUT/lora_offline_h200.json.
# serve: a 1000-job burst, 256 in / 256 out, at 256 seats, through API, gateway and worker as
#   processes: the base model's jobs, then jobs spread uniformly over the 8 adapters
#   (model "<base>:adapterN"), then one job at a time without and with an adapter; each a
#   serve.py run into $OUT/lora_serve_h200_{base,mixed,one_base,one_lora}.json.
# Everything printed goes to $OUT/session.log too. A rehearsal on a CPU machine, with the
# project's environment first on PATH: NO_WHEELS=1 PRESET=tiny DEVICE=cpu COUNT=3, and small
# sizes as extra arguments.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:?offline or serve}
shift
exec > >(tee -a "$OUT/session.log") 2>&1
BUDGET_S=${SESSION_BUDGET_S:-570}  # the call's 10 minutes less a margin for the copy back

source benchmarks/sessions/device_session_env.sh
echo "cores: $(nproc); $(python3 -c 'import torch, triton
print("torch", torch.__version__, "triton", triton.__version__)')"

PRESET=${PRESET:-llama-3-8b}
COUNT=${COUNT:-8}
ADAPTERS=${ADAPTERS:-/tmp/lora-adapters}
if [[ ! -f $ADAPTERS/adapter$((COUNT - 1))/adapter_config.json ]]; then
  python3 -m tidegate.benchmarks.engine.lora_throughput write-adapters "$ADAPTERS" --preset "$PRESET" \
    --count "$COUNT" --rank 16 || exit 1
fi
names=()
for ((i = 0; i < COUNT; i++)); do names+=("adapter$i"); done
echo "adapters ready after ${SECONDS}s"

if [[ $what == offline ]]; then
  timeout $((BUDGET_S - SECONDS)) python3 -m tidegate.benchmarks.engine.lora_throughput run \
    --model "random:$PRESET" --device "${DEVICE:-cuda}" \
    --adapters "${names[@]/#/$ADAPTERS/}" --out "$OUT/lora_offline_h200.json" "$@"
  exit $?
fi

[[ $what == serve ]] || { echo "offline or serve, not $what"; exit 2; }
.redisbin/run-redis --version || exit 1
loras=()
for name in "${names[@]}"; do loras+=(--lora "$name=$ADAPTERS/$name"); done
common=(--redis-server "$PWD/.redisbin/run-redis" --device "${DEVICE:-cuda}" --model "random:$PRESET"
        --max-num-seqs 256 --max-num-batched-tokens 16384 --input-len 256 --output-len 256
        --client-procs 4 --startup-timeout-s 300 --plot "" --env "TIDEGATE_MAX_LORAS=$COUNT"
        "${loras[@]}")
RESULTS=lora_serve_h200  # serve() writes $OUT/${RESULTS}_NAME.json
left() { echo $((BUDGET_S - SECONDS)); }
serve base $(( $(left) / 4 )) --only burst --burst 1000 "$@"
serve mixed $(( $(left) / 3 )) --only burst --burst 1000 --adapters "${names[@]}" "$@"
serve one_base $(( $(left) / 2 )) --only burst --burst 1 --output-len 512 "$@"
serve one_lora $(( $(left) - 20 )) --only burst --burst 1 --output-len 512 \
  --adapters "${names[0]}" "$@"
tar czf "$OUT/lora_serve_logs.tgz" -C /tmp logs 2>/dev/null
exit $status
