#!/usr/bin/env bash
# How much slower the target's step runs beside the draft's on one machine's two cores: what the
# prompts bench's `split` setup (one node pinned to each core) pays that two machines would not
# (issue 54; docs/benchmarks/prompts.md, "Session 35"; the bench's BENCH_BESIDE).
#
#   scripts/interference.sh
#
# Starts the target-node pinned to core A, the draft-node to core B and `coordinator serve`
# beside the target, STARTS times, and reads what the coordinator's warm-up timed before its
# first request (`engine/warm_up.rs`): the target's step alone and beside a draft-node step of 4
# tokens. Prints each start's pair and the median slowdown (beside / alone − 1). With
# NODES=once the nodes start once and only the coordinator STARTS times: what one process's
# sample reads on the same nodes (docs/benchmarks/prompts.md, "Session 36").
#
# Environment: TANDEM_QWEN_DIR (default ~/.cache/tandem/models: scripts/fetch-qwen-pair.sh),
# TARGET, DRAFT (the .gguf files; default the Qwen pair there), CORES ("0 1": A and B), STARTS
# (8), BIN (the release binaries' folder; default target/release, built there if missing).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${TANDEM_QWEN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models}
target=${TARGET:-$dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
draft=${DRAFT:-$dir/qwen2.5-coder-0.5b-instruct.gguf}
read -r core_a core_b <<< "${CORES:-0 1}"
starts=${STARTS:-8}
bin=${BIN:-$repo/target/release}
for f in "$target" "$draft"; do
    [ -f "$f" ] || { echo "missing $f (scripts/fetch-qwen-pair.sh fetches the pair)" >&2; exit 1; }
done
if [ ! -x "$bin/coordinator" ] || [ ! -x "$bin/target-node" ] || [ ! -x "$bin/draft-node" ]; then
    (cd "$repo" && cargo build --release -p tandem-coordinator -p tandem-target-node \
        -p tandem-draft-node --bins)
fi
logs=$(mktemp -d)
pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2> /dev/null || true; done
    pids=()
}
trap 'stop; kill "${coordinator:-}" 2> /dev/null; rm -rf "$logs"' EXIT

# Waits until FILE has a line matching PATTERN, while process PID lives.
await() {
    local file=$1 pattern=$2 pid=$3
    until grep -q "$pattern" "$file" 2> /dev/null; do
        kill -0 "$pid" 2> /dev/null || { echo "exited early: $(tail -3 "$file")" >&2; exit 1; }
        sleep 0.2
    done
}

# Free loopback ports for this start's three servers.
ports() {
    python3 -c 'import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))'
}

# Starts the target-node and the draft-node, each pinned to its core, on ports $tp and $dp.
nodes() {
    RUST_LOG=info taskset -c "$core_a" "$bin/target-node" --model "$target" \
        --listen "127.0.0.1:$tp" > "$logs/target" 2>&1 &
    pids+=($!)
    await "$logs/target" listening "${pids[-1]}"
    RUST_LOG=info taskset -c "$core_b" "$bin/draft-node" --model "$draft" \
        --listen "127.0.0.1:$dp" > "$logs/draft" 2>&1 &
    pids+=($!)
    await "$logs/draft" listening "${pids[-1]}"
}

pairs=()
for n in $(seq "$starts"); do
    if [ "${NODES:-each}" != once ] || [ "$n" = 1 ]; then
        read -r tp dp cp <<< "$(ports)"
        nodes
    else
        read -r _ _ cp <<< "$(ports)"
    fi
    RUST_LOG=info NO_COLOR=1 taskset -c "$core_a" "$bin/coordinator" serve \
        --target "http://127.0.0.1:$tp" --draft "http://127.0.0.1:$dp" \
        --listen "127.0.0.1:$cp" > "$logs/coordinator" 2>&1 &
    coordinator=$!
    await "$logs/coordinator" "nodes timed\|not timed" "$coordinator"
    line=$(sed 's/\x1b\[[0-9;]*m//g' "$logs/coordinator" | grep "nodes timed" || true)
    alone=$(grep -o 'target_step_ms=[0-9.]*' <<< "$line" | cut -d= -f2)
    beside=$(grep -o 'target_beside_draft_ms=[0-9.]*' <<< "$line" | cut -d= -f2)
    kill "$coordinator" 2> /dev/null || true
    wait "$coordinator" 2> /dev/null || true
    [ "${NODES:-each}" = once ] || stop
    [ -n "$alone" ] || { echo "start $n: the warm-up did not time the nodes" >&2; continue; }
    printf 'start %d: target step %.1f ms alone, %.1f ms beside the draft step\n' \
        "$n" "$alone" "$beside"
    pairs+=("$alone:$beside")
done
python3 - "${pairs[@]}" <<'PY'
import statistics, sys
slow = sorted(float(b) / float(a) - 1 for a, b in (p.split(":") for p in sys.argv[1:]))
print(f"median slowdown beside the draft: {100 * statistics.median(slow):.0f} % "
      f"(starts: {', '.join(f'{100 * s:.0f}' for s in slow)} %)")
PY
