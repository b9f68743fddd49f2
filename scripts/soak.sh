#!/usr/bin/env bash
# Runs the whole test suite (the README's test command, `cargo test --workspace`) RUNS times in a
# row and prints each test that failed with how often, so a test that passes only most of the
# time shows up. With --load, every core is kept busy by an unrelated load (one `sha256sum` of an
# endless stream per core, at normal priority) for the whole soak, as on a shared machine.
#
# Usage: scripts/soak.sh RUNS [--load] [-- EXTRA CARGO TEST ARGS]
#   e.g. scripts/soak.sh 20; scripts/soak.sh 5 --load; scripts/soak.sh 10 -- -p tandem-tests --test reliability
# Each run's output goes to $SOAK_DIR (default target/soak/<date>) as run-N.log; a run that takes
# longer than $SOAK_RUN_TIMEOUT (default 45m) is killed and counted as hung. Exits 0 only when
# every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:?usage: scripts/soak.sh RUNS [--load] [-- EXTRA CARGO TEST ARGS]}
shift
load=false
if [ "${1:-}" = --load ]; then
  load=true
  shift
fi
[ "${1:-}" = -- ] && shift
extra=("$@")
dir=${SOAK_DIR:-target/soak/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$dir"

# Build everything the tests run first, so the runs time the tests, not the compiler.
cargo test --workspace --no-run "${extra[@]}" >"$dir/build.log" 2>&1 || {
  echo "build failed: see $dir/build.log" >&2
  exit 1
}

loaders=()
stop_load() {
  ((${#loaders[@]})) && kill "${loaders[@]}" 2>/dev/null
  wait 2>/dev/null
}
trap stop_load EXIT
if $load; then
  for _ in $(seq "$(nproc)"); do
    sha256sum /dev/zero >/dev/null &
    loaders+=($!)
  done
  echo "load: ${#loaders[@]} busy processes (one per core)"
fi

declare -A failed=()
passed_runs=0
for run in $(seq "$runs"); do
  log="$dir/run-$run.log"
  start=$(date +%s)
  timeout --kill-after=30s "${SOAK_RUN_TIMEOUT:-45m}" cargo test --workspace "${extra[@]}" >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  # libtest prints `test NAME ... FAILED` for each failed test; the binary is named on the
  # `Running` line above it.
  names=$(awk '/^     Running /{bin=$2} / \.\.\. FAILED$/{sub(/^test /,""); sub(/ \.\.\. FAILED$/,""); print bin": "$0}' "$log" | sort -u)
  if [ "$rc" -eq 0 ]; then
    passed_runs=$((passed_runs + 1))
    echo "run $run: ok (${secs} s)"
  else
    case $rc in
      124 | 137) names=$(printf '%s\n%s' "$names" "(run hung: killed after ${SOAK_RUN_TIMEOUT:-45m})") ;;
    esac
    [ -n "$names" ] || names="(failed without a failing test line: see the log)"
    echo "run $run: FAILED rc=$rc (${secs} s), log $log"
    while IFS= read -r name; do
      [ -n "$name" ] || continue
      echo "    $name"
      failed[$name]=$((${failed[$name]:-0} + 1))
    done <<<"$names"
  fi
done

echo
echo "$passed_runs of $runs runs passed$($load && echo ', under load')"
if ((${#failed[@]})); then
  echo "failures (count, test):"
  for name in "${!failed[@]}"; do
    printf '%4d  %s\n' "${failed[$name]}" "$name"
  done | sort -rn
  exit 1
fi
