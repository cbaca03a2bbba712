#!/usr/bin/env bash
# Issue 40's measure: RUNS consecutive `make test` runs, each on a fresh clone of COMMIT (default
# HEAD) with its own fresh venv, the install timed apart. One line per run on stdout (and in
# LOG): the run, its start, the install's and the tests' wall time, pytest's summary line.
# Stops at the first run that fails, keeping that run's output.
#   bash benchmarks/suite/clean_runs.sh [RUNS] [COMMIT]
set -uo pipefail
runs=${1:-10}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse "${2:-HEAD}")
work=$(mktemp -d /tmp/tidegate-runs.XXXX)
log=${LOG:-$work/runs.tsv}
echo "# $runs clean runs of ${commit:0:7} on $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p')); logs in $work" | tee -a "$log"
for i in $(seq 1 "$runs"); do
    dir=$work/run$i
    git clone -q "$repo" "$dir" && git -C "$dir" checkout -q "$commit"
    start=$(date -u +%H:%M:%S)
    t0=$(date +%s)
    (cd "$dir" && make setup) > "$dir.setup.log" 2>&1 || { echo "run $i: install failed ($dir.setup.log)" | tee -a "$log"; exit 1; }
    t1=$(date +%s)
    (cd "$dir" && make test) > "$dir.test.log" 2>&1
    code=$?
    t2=$(date +%s)
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$dir.test.log" | tail -1 | tr -d '=')
    printf 'run %d\t%s\tinstall %ds\ttests %dm%02ds\t%s\n' "$i" "$start" $((t1 - t0)) \
        $(((t2 - t1) / 60)) $(((t2 - t1) % 60)) "$summary" | tee -a "$log"
    [ "$code" -eq 0 ] || { echo "run $i failed: $dir.test.log" | tee -a "$log"; exit 1; }
    rm -rf "$dir"
done
