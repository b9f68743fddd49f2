#!/usr/bin/env bash
# The GPU checks of issue 26, run on a machine with an NVIDIA GPU and no Rust toolchain, from
# binaries built elsewhere by `scripts/gpu-check.sh --build` (with scripts/build-cuda.sh), packed
# into gpu/bin.tar.xz (carried there with the repository) and unpacked there to gpu/bin:
#   gpu/bin/target-node          --features cuda
#   gpu/bin/{coordinator,draft-node}   for the CPU
#   gpu/bin/deps/cuda            runtime/tests/cuda.rs (batch invariance, greedy exactness)
#   gpu/bin/deps/verify          runtime/benches/verify.rs, this tree (our CUDA path)
#   gpu/bin/deps/verify-stock    the same bench over the runtime before the CUDA path
#                                (candle's kernels: GPU_STOCK_REV, default the commit before it)
#   gpu/bin/deps/concurrency     tests/benches/concurrency.rs (spawns gpu/bin's binaries)
#   gpu/bin/deps/link            tests/benches/link.rs (likewise, the draft behind a delaying link)
# Then, there: `scripts/gpu-check.sh [OUT_DIR] [STEP...]` runs each check with a deadline, its
# output to OUT_DIR (default ./gpu-out) and the terminal; steps: tests, verify, concurrency, link
# (default all four).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--build" ]; then
    set -e
    eval "$(scripts/build-cuda.sh --print-env)"
    scripts/build-cuda.sh --release -p tandem-target-node --bins
    tests=$(cargo test --release -p tandem-runtime --features cuda --test cuda --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable')
    bench=$(cargo bench -p tandem-runtime --features cuda --bench verify --no-run \
        --message-format=json | jq -r 'select(.executable != null) | .executable')
    rm -rf gpu && mkdir -p gpu/bin/deps
    cp "$CARGO_TARGET_DIR/release/target-node" gpu/bin/
    (
        unset CARGO_TARGET_DIR RUSTFLAGS
        cargo build --release -p tandem-coordinator -p tandem-draft-node --bins
        for b in coordinator draft-node; do cp "target/release/$b" gpu/bin/; done
        for bench in concurrency link; do
            cargo bench -p tandem-tests --bench $bench --no-run --message-format=json \
                | jq -r 'select(.executable != null) | .executable' >target/$bench.path
        done
    )
    cp "$(cat target/concurrency.path)" gpu/bin/deps/concurrency
    cp "$(cat target/link.path)" gpu/bin/deps/link
    cp "$tests" gpu/bin/deps/cuda
    cp "$bench" gpu/bin/deps/verify
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
    # One archive with a window past a binary's size: the CUDA binaries' kernels are stored once.
    tar -C gpu -cf - bin | xz -T2 --lzma2=preset=9,dict=512MiB >gpu/bin.tar.xz
    rm -rf gpu/bin
    du -sh gpu/bin.tar.xz

    exit 0
fi

out=${1:-gpu-out}
shift || true
steps=${*:-tests verify concurrency link}
mkdir -p "$out"
[ -d gpu/bin ] || xz -dc gpu/bin.tar.xz | tar -C gpu -xf -
built=$(cat gpu/built-at)
if [ "$built" != "$PWD" ]; then
    mkdir -p "$(dirname "$built")" && ln -sfn "$PWD" "$built"
fi
mkdir -p target/stock && ln -sfn "$PWD/fixtures" target/stock/fixtures
# The CUDA libraries candle loads (cuBLAS, cuRAND, NVRTC), wherever the machine has them.
for lib in libcublas.so.13 libcudart.so.13 libcurand.so.10 libnvrtc.so.13; do
    dir=$(dirname "$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1)")
    export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export TANDEM_PREBUILT=1 RUST_LOG=warn
step() { # NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    case " $steps " in *" ${name%%-*} "*) ;; *) return ;; esac
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: rc ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
step tests 150 gpu/bin/deps/cuda --test-threads 1
# Writes the random 1.5B-shape model once (single-threaded, ~a minute), then alternates.
BENCH_DEVICE=cuda BENCH_MODEL=random-1.5b BENCH_ROWS=1 BENCH_ITERS=1 \
    step verify-warm 200 gpu/bin/deps/verify
for rep in 1 2; do
    for variant in verify verify-stock; do
        BENCH_DEVICE=cuda BENCH_MODEL=random-1.5b BENCH_DTYPE=${GPU_DTYPE:-bf16} \
            BENCH_ROWS=1,5,9,17 BENCH_SEQS=64 BENCH_ITERS=20 \
            step "$variant-$rep" 90 gpu/bin/deps/$variant
    done
done
BENCH_TARGET_ARGS="--device cuda" BENCH_SESSIONS=${GPU_SESSIONS:-1,8,32,64} \
    BENCH_VARIANTS=target-only,auto,4 BENCH_BATCH=64 BENCH_CPUS=8-15,0-7 \
    step concurrency 280 gpu/bin/deps/concurrency
BENCH_TARGET_ARGS="--device cuda" BENCH_RTT_MS=0,20 BENCH_MBIT=0 BENCH_VARIANTS=target-only,auto \
    BENCH_REPS=3 BENCH_CPUS=8-15,0-7 step link 200 gpu/bin/deps/link
