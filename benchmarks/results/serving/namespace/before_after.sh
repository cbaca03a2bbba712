#!/usr/bin/env bash
# Before (37635eb, old layout) and after (issue 39) serve runs, interleaved, same machine.
PY=/work/main/.venv/bin/python
SM="--model smollm2 --burst 32 --length-dist uniform --input-range 16 256 --output-range 16 128 --torch-threads 1 --plot "
TI="--model random:tiny --max-num-seqs 256 --max-num-batched-tokens 2048 --burst 600 --input-len 64 --output-len 64 --torch-threads 1 --plot "
before() { (cd /tmp/before && $PY benchmarks/serve.py $2 "" --out /tmp/ba/$1.json --logdir /tmp/ba/logs_$1) > /tmp/ba/$1.log 2>&1; echo "$1 rc=$?"; }
after() { (cd /tmp && $PY -P -m tidegate.benchmarks.serving.serve $2 "" --out /tmp/ba/$1.json --logdir /tmp/ba/logs_$1) > /tmp/ba/$1.log 2>&1; echo "$1 rc=$?"; }
date
before smollm2_before_1 "$SM"; after smollm2_after_1 "$SM"
before smollm2_before_2 "$SM"; after smollm2_after_2 "$SM"
before tiny_before_1 "$TI"; after tiny_after_1 "$TI"
before tiny_before_2 "$TI"; after tiny_after_2 "$TI"
before tiny_before_3 "$TI"; after tiny_after_3 "$TI"
after smollm2_after_3 "$SM"; before smollm2_before_3 "$SM"
date
