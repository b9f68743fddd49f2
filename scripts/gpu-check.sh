#!/usr/bin/env bash
# The GPU checks of issue 26, run on a machine with an NVIDIA GPU and no Rust toolchain, from
# binaries built elsewhere by `scripts/gpu-check.sh --build` (with scripts/build-cuda.sh) into
# gpu/ (carried there with the repository):
#   gpu/bin/{coordinator,target-node,draft-node}   --features cuda
#   gpu/bin/deps/cuda            runtime/tests/cuda.rs (batch invariance, greedy exactness)
#   gpu/bin/deps/verify          runtime/benches/verify.rs, this tree (our CUDA path)
#   gpu/bin/deps/verify-stock    the same bench over the runtime before the CUDA path
#                                (candle's kernels: GPU_STOCK_REV, default the commit before it)
#   gpu/bin/deps/concurrency     tests/benches/concurrency.rs (spawns gpu/bin's binaries)
# Then, there: `scripts/gpu-check.sh [OUT_DIR]` runs each check with a deadline, its output to
# OUT_DIR (default ./gpu-out) and the terminal.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--build" ]; then
    set -e
    eval "$(scripts/build-cuda.sh --print-env)"
    scripts/build-cuda.sh --release -p tandem-coordinator -p tandem-target-node \
        -p tandem-draft-node --bins
    tests=$(cargo test --release -p tandem-runtime --features cuda --test cuda --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable')
    bench=$(cargo bench -p tandem-runtime --features cuda --bench verify --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable')
    conc=$(cargo bench -p tandem-tests --bench concurrency --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable')
    mkdir -p gpu/bin/deps
    for b in coordinator target-node draft-node; do cp "$CARGO_TARGET_DIR/release/$b" gpu/bin/; done
    cp "$tests" gpu/bin/deps/cuda
    cp "$bench" gpu/bin/deps/verify
    cp "$conc" gpu/bin/deps/concurrency
    # The stock bench: the runtime as it was, this tree's bench file.
    stock=${GPU_STOCK_REV:-$(git log --format=%H -1 --diff-filter=A -- runtime/src/kernels/cuda.rs)^}
    rm -rf target/stock && git worktree add -f --detach target/stock "$stock" >/dev/null
    cp runtime/benches/verify.rs target/stock/runtime/benches/verify.rs
    (cd target/stock && cargo bench -p tandem-runtime --features cuda --bench verify --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable') >target/stock.path
    cp "$(cat target/stock.path)" gpu/bin/deps/verify-stock
    git worktree remove --force target/stock
    strip gpu/bin/* gpu/bin/deps/* 2>/dev/null || true
    # The binaries find the fixtures where they were built: the GPU machine links that path.
    echo "$PWD" >gpu/built-at
    du -sh gpu
    exit 0
fi

out=${1:-gpu-out}
mkdir -p "$out"
built=$(cat gpu/built-at)
if [ "$built" != "$PWD" ]; then
    mkdir -p "$(dirname "$built")" && ln -sfn "$PWD" "$built"
fi
mkdir -p target/stock && ln -sfn "$PWD/fixtures" target/stock/fixtures
# The CUDA libraries candle loads (cuBLAS, cuRAND, NVRTC), wherever the machine has them.
for lib in libcublas.so.13 libcurand.so.10 libnvrtc.so.13; do
    dir=$(dirname "$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1)")
    export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export TANDEM_PREBUILT=1 RUST_LOG=warn
step() { # NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: rc ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
step tests 240 gpu/bin/deps/cuda --test-threads 1
for rep in 1 2; do
    for variant in verify verify-stock; do
        BENCH_DEVICE=cuda BENCH_MODEL=random-1.5b BENCH_DTYPE=${GPU_DTYPE:-bf16} \
            BENCH_ROWS=1,5,9,17 BENCH_SEQS=64 BENCH_ITERS=20 \
            step "$variant-$rep" 150 gpu/bin/deps/$variant
    done
done
BENCH_TARGET_ARGS="--device cuda" BENCH_SESSIONS=${GPU_SESSIONS:-1,8,32,64} \
    BENCH_VARIANTS=target-only,auto,1,4,8 BENCH_BATCH=64 BENCH_CPUS=8-15,0-7 \
    step concurrency 300 gpu/bin/deps/concurrency
