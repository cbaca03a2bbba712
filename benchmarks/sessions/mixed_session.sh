#!/usr/bin/env bash
# One GPU-machine call of the mixed-load comparison (issue 43): serve.py on the same chat-like
# mix, once per variant of the stack, one after another on the same card.
#
#   bash benchmarks/sessions/mixed_session.sh "NAME|LIMIT_S|serve.py arguments" ...
#
# Each variant runs `serve.py ${COMMON} <its arguments>` within LIMIT_S seconds, into
# $OUT/mixed_NAME.json.gz (per-job details in it: --save-detailed is common). COMMON (the environment)
# holds the arguments all variants share; by default the issue's stack and mix: one worker,
# random Llama-3-8B shape, bf16, 1024 seats, 16,384 tokens a step, prompts uniform in
# 100-2000 tokens, outputs in 50-500, every job followed over its WebSocket.
# Run from the repository root on the device machine (the `device` tool's `run`), $OUT set.
# Carried (git-ignored, named in the call's `carry`): .whl/ and .redisbin/ as serve_session.sh
# says; .base/base.tar (optional): `git archive` of an earlier commit, installed to
# /tmp/site-base, so a variant given `--env PYTHONPATH=/tmp/site-base:/tmp/site` runs its stack
# (API, gateway, workers) on that commit's code beside this checkout's, on the same machine.
# TESTS="tests/..." (optional): pytest those first, on the machine's CPU cores (the wheels pytest
# needs beyond the image's: pytest-asyncio, jsonschema and its parts, carried in .whl/).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1

source benchmarks/sessions/device_session_env.sh
.redisbin/run-redis --version || exit 1
if [[ -f .base/base.tar && ! -d /tmp/site-base/tidegate ]]; then
  rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar xf .base/base.tar -C /tmp/base-src &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --no-cache-dir --upgrade --target /tmp/site-base /tmp/base-src || exit 1
fi
if [[ -n "${TESTS:-}" ]]; then  # CPU tests of the change first (TESTS="tests/..."), on 8 cores
  mkdir -p /tmp/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$PWD/.redisbin/run-redis-server" \
    > /tmp/bin/redis-server && chmod +x /tmp/bin/redis-server
  PATH=/tmp/bin:$PATH timeout "${TESTS_LIMIT_S:-150}" python3 -m pytest -q -p no:cacheprovider \
    -o addopts="--import-mode=append" -W default -n 8 $TESTS 2>&1 | tail -30
fi
read -r -a common <<< "${COMMON:---device cuda --model random:llama-3-8b --max-num-seqs 1024 \
--max-num-batched-tokens 16384 --length-dist uniform --input-range 100 2000 --output-range 50 500 \
--client-procs 4 --save-detailed --plot=}"
common=(--redis-server "$PWD/.redisbin/run-redis" "${common[@]}")
RESULTS=mixed
for variant in "$@"; do
  IFS='|' read -r name limit rest <<< "$variant"
  read -r -a more <<< "$rest"
  left=$(( ${SESSION_BUDGET_S:-570} - SECONDS ))
  (( limit > left )) && limit=$left
  (( limit < 60 )) && { echo "== $name: skipped, ${left}s left"; continue; }
  serve "$name" "$limit" "${more[@]}"
  gzip -f "$OUT/${RESULTS}_$name.json" 2>/dev/null  # per-job details: megabytes of gaps
  tar czf "$OUT/$name-logs.tgz" -C "/tmp/logs/$name" . 2>/dev/null
done
exit $status
