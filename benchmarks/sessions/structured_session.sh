#!/usr/bin/env bash
# One GPU-machine call for JSON-schema-constrained decoding against free decoding, on Llama-3-8B's
# shape (random bf16 weights, 128,256 logits) with SmolLM2's real 49,152-token tokenizer: the
# grammar masks cost what they cost with a real vocabulary, not the random presets' 260 tokens.
#
#   bash benchmarks/sessions/structured_session.sh offline          # the engine alone, one process
#   bash benchmarks/sessions/structured_session.sh serve [serve.py arguments...]   # the whole stack
#
# Run from the repository root on the device machine (the `device` tool's `run`), with $OUT set.
# Carried (git-ignored, named in the call's `carry`):
#   .whl/         the wheels the image lacks (llguidance, redis, pydantic, starlette, ...,
#                 and jsonschema with its needs, for checking outputs against their schemas),
#                 installed to /tmp/site;
#   .redisbin/    redis-server and the shared libraries the image lacks (serve only), started
#                 through .redisbin/run-redis;
#   .tokenizers/smollm2/  the default model's tokenizer files (Tokenizer.save), which the model
#                 directory takes.
# Both modes first write the model directory $MODEL_DIR (default /tmp/llama8b-smollm2; kept
# when a machine still warm from the last call has it) with
# benchmarks/engine/structured_throughput.py write-model; every process then loads it as --model.
# offline: benchmarks/engine/structured_throughput.py run (free, every request constrained, half, free
#   again, and the realistic schema set tests/fixtures/json_schemas.json where it exists), into
#   $OUT/structured_offline_h200.json (texts: $OUT/structured_offline_texts.json).
# serve: a 1000-job burst, 256 in / 256 out, at 256 seats, free then every job constrained by
#   DEFAULT_SCHEMA (then, with MIXED=1 and time left, the schema set), each a serve.py run into
#   $OUT/structured_serve_h200_{free,json,mixed}.json, logs as $OUT/structured_serve_logs.tgz.
# Everything printed goes to $OUT/session.log too. A rehearsal on a CPU machine, with the
# project's environment first on PATH: NO_WHEELS=1 PRESET=tiny VOCAB_SIZE=128256 DEVICE=cpu, and
# small sizes as extra arguments (offline --requests 16 --max-num-seqs 8 --input-len 32
# --output-len 16; serve --burst 8 --input-len 32 --output-len 16).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:?offline or serve}
shift
exec > >(tee -a "$OUT/session.log") 2>&1
BUDGET_S=${SESSION_BUDGET_S:-570}  # the call's 10 minutes less a margin for the copy back

source benchmarks/sessions/device_session_env.sh
echo "cores: $(nproc); $(python3 -c 'import torch, triton, llguidance as g
print("torch", torch.__version__, "triton", triton.__version__, "llguidance", g.__version__)')"

MODEL_DIR=${MODEL_DIR:-/tmp/llama8b-smollm2}
python3 -m tidegate.benchmarks.engine.structured_throughput write-model "$MODEL_DIR" \
  --preset "${PRESET:-llama-3-8b}" ${VOCAB_SIZE:+--vocab-size "$VOCAB_SIZE"} \
  --tokenizer .tokenizers/smollm2 || exit 1
schema=/tmp/structured-schema.json
python3 -c 'import json; from tidegate.benchmarks.engine.structured_throughput import DEFAULT_SCHEMA as s
print(json.dumps(s))' >"$schema" || exit 1
echo "model directory ready after ${SECONDS}s"

if [[ $what == offline ]]; then
  timeout $((BUDGET_S - SECONDS)) python3 -m tidegate.benchmarks.engine.structured_throughput run \
    --model "$MODEL_DIR" --device "${DEVICE:-cuda}" \
    --out "$OUT/structured_offline_h200.json" --texts "$OUT/structured_offline_texts.json" "$@"
  exit $?
fi

[[ $what == serve ]] || { echo "offline or serve, not $what"; exit 2; }
.redisbin/run-redis --version || exit 1
common=(--redis-server "$PWD/.redisbin/run-redis" --device "${DEVICE:-cuda}" --model "$MODEL_DIR"
        --max-num-seqs 256 --max-num-batched-tokens 16384 --burst 1000 --input-len 256
        --output-len 256 --client-procs 4 --only burst --startup-timeout-s 300 --plot "" "$@")
RESULTS=structured_serve_h200  # serve() writes $OUT/${RESULTS}_NAME.json
# The free run may take what leaves the constrained one 200 s.
serve free $(( BUDGET_S - SECONDS - 200 < 260 ? BUDGET_S - SECONDS - 200 : 260 ))
serve json $(( BUDGET_S - SECONDS - 10 )) --response-format "$schema"
set_file=tests/fixtures/json_schemas.json
if [[ -n ${MIXED:-} && -f $set_file ]] && (( BUDGET_S - SECONDS > 150 )); then
  serve mixed $(( BUDGET_S - SECONDS - 10 )) --response-format "$set_file" --no-engine-alone
fi
tar czf "$OUT/structured_serve_logs.tgz" -C /tmp/logs . 2>/dev/null
exit $status
