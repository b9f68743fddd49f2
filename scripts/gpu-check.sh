#!/usr/bin/env bash
# The GPU checks of issue 26, run on a machine with an NVIDIA GPU and no Rust toolchain, from
# binaries built elsewhere by `scripts/gpu-check.sh --build` (with scripts/build-cuda.sh), packed
# into gpu/bin.tar.xz (carried there with the repository) and unpacked there to gpu/bin:
#   gpu/bin/target-node          --features cuda
#   gpu/bin/{coordinator,draft-node}   for the CPU
#   gpu/bin/deps/cuda            runtime/tests/cuda.rs (batch invariance, greedy exactness)
#   gpu/bin/deps/verify          runtime/benches/verify.rs, this tree (our CUDA path)
#   gpu/bin/deps/verify-stock    the same bench over the runtime before the CUDA path
#                                (candle's kernels: GPU_STOCK_REV, default the commit before it;
#                                GPU_STOCK=0 leaves it out)
#   gpu/bin/deps/concurrency     tests/benches/concurrency.rs (spawns gpu/bin's binaries)
#   gpu/bin/deps/link            tests/benches/link.rs (likewise, the draft behind a delaying link)
# Then, there: `scripts/gpu-check.sh [OUT_DIR] [STEP...]` runs each check with a deadline, its
# output to OUT_DIR (default ./gpu-out) and the terminal; steps: tests, verify, concurrency, link
# (default these four; GPU_REPS: the verify and link benches' reps), and with the real
# Qwen2.5-Coder pair: kv (the target's default KV-cache budget on the GPU), qwen (every variant's
# output equal to
# target-only's, 1 and 64 sessions, bf16 and f16), qlink (the CPU draft's speedup at RTT 0 and
# 20 ms), llamacpp (llama.cpp built with CUDA on the same files: `--llama`). The GPU's memory in use
# is sampled all along (gpu-memory.csv).
#
# The pair (1.6 GB) cannot travel in one call (64 MiB): `scripts/gpu-check.sh --split QWEN_DIR DIR`
# cuts it here into compressed pieces of 52 MiB; each call carries one as gpu/q/ and runs
# `scripts/gpu-check.sh --receive` (kept in gpu/pieces/ while the machine stays warm); the qwen
# steps join and checksum them first.
#
# `scripts/gpu-check.sh --llama BUILD_DIR` packs llama.cpp's CUDA build (llama-bench,
# llama-speculative and their libraries; cmake -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 with
# the nvcc of scripts/build-cuda.sh) into gpu/llama.tar.xz.
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
    rm -rf gpu/bin && mkdir -p gpu/bin/deps
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
    # The stock bench (GPU_STOCK=1): the runtime as it was, this tree's bench file.
    if [ "${GPU_STOCK:-1}" = 1 ]; then
        stock=${GPU_STOCK_REV:-$(git log --format=%H -1 --diff-filter=A -- runtime/src/kernels/cuda.rs)^}
        rm -rf target/stock && git worktree add -f --detach target/stock "$stock" >/dev/null
        cp runtime/benches/verify.rs target/stock/runtime/benches/verify.rs
        # Its own target folder: cargo names a workspace's artifacts by their relative path,
        # so the old runtime would overwrite this tree's.
        (cd target/stock && CARGO_TARGET_DIR=$CARGO_TARGET_DIR-stock cargo bench -p tandem-runtime --features cuda --bench verify --no-run \
            --message-format=json | jq -r 'select(.executable != null) | .executable') >target/stock.path
        cp "$(cat target/stock.path)" gpu/bin/deps/verify-stock
        git worktree remove --force target/stock
    fi
    strip gpu/bin/* gpu/bin/deps/* 2>/dev/null || true
    # The binaries find the fixtures where they were built: the GPU machine links that path.
    echo "$PWD" >gpu/built-at
    # One archive with a window past a binary's size: the CUDA binaries' kernels are stored once.
    tar -C gpu -cf - bin | xz -T2 --lzma2=preset=9,dict=512MiB >gpu/bin.tar.xz
    rm -rf gpu/bin
    du -sh gpu/bin.tar.xz

    exit 0
fi

qwen_files="qwen2.5-coder-0.5b-instruct.gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
qwen_sums="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
case "${1:-}" in
--split)
    set -e
    mkdir -p "$3"
    for f in $qwen_files; do
        zstd -q -T0 -c "$2/$f" | split -b 54525952 -d -a 2 - "$3/${f%%-instruct*}."
    done
    ls "$3"
    exit 0
    ;;
--receive)
    mkdir -p gpu/pieces && mv gpu/q/* gpu/pieces/ && ls gpu/pieces | wc -l
    exit 0
    ;;
--llama)
    set -e
    rm -rf gpu/llama && mkdir -p gpu/llama
    cp -P "$2"/bin/llama-bench "$2"/bin/llama-speculative "$2"/bin/lib*.so* gpu/llama/
    # The commit measured: the source's git, or GPU_LLAMA_COMMIT (a source release has no git).
    echo "${GPU_LLAMA_COMMIT:-$(git -C "$2/.." rev-parse HEAD 2>/dev/null || echo unknown)}" \
        >gpu/llama/commit
    strip gpu/llama/* 2>/dev/null || true
    tar -C gpu -cf - llama | xz -T2 -9 >gpu/llama.tar.xz
    rm -rf gpu/llama
    du -sh gpu/llama.tar.xz
    exit 0
    ;;
esac

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
unzstd() { # stdin to stdout: zstd, or Python's (3.14), or pyarrow's where zstd is missing
    if command -v zstd >/dev/null; then
        zstd -dcq
    else
        python3 -c '
import shutil, sys
try:
    from compression import zstd
    shutil.copyfileobj(zstd.ZstdFile(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)
except ImportError:
    import pyarrow as pa
    with pa.CompressedInputStream(pa.PythonFile(sys.stdin.buffer, mode="r"), "zstd") as f:
        while chunk := f.read(1 << 24):
            sys.stdout.buffer.write(chunk)
'
    fi
}
qwen() { # joins the pieces once, checks them, points the tests at them
    export TANDEM_QWEN_DIR=$PWD/gpu/qwen
    mkdir -p "$TANDEM_QWEN_DIR" && find "$TANDEM_QWEN_DIR" -type l -delete
    local files=($qwen_files) sums=($qwen_sums) i f
    for i in "${!files[@]}"; do
        f=${files[i]}
        if [ ! -f "$TANDEM_QWEN_DIR/$f" ]; then
            cat gpu/pieces/"${f%%-instruct*}".* 2>/dev/null | unzstd >"$TANDEM_QWEN_DIR/$f"
        fi
        if [ "$(sha256sum <"$TANDEM_QWEN_DIR/$f" 2>/dev/null | cut -d' ' -f1)" != "${sums[i]}" ]; then
            echo "$f: incomplete ($(ls gpu/pieces | grep -c "${f%%-instruct*}") pieces)"
            rm -f "$TANDEM_QWEN_DIR/$f"
        fi
    done | tee "$out/qwen.txt"
    local target=$TANDEM_QWEN_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    local draft=$TANDEM_QWEN_DIR/qwen2.5-coder-0.5b-instruct.gguf
    [ -f "$draft" ] || return 1
    # Without the 1.5B (the pair takes 30 calls to carry): the 0.5B is the target and the draft.
    [ -f "$target" ] || { ln -s "$draft" "$target" && echo "TARGET = the 0.5B" | tee -a "$out/qwen.txt"; }
}
step() { # NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    case " $steps " in *" ${name%%-*} "*) ;; *) return ;; esac
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: rc ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv -lms 250 >"$out/gpu-memory.csv" &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
case " $steps " in *" qwen "* | *" qlink "* | *" kv "* | *" llamacpp "*) qwen || exit 1 ;; esac
step tests 150 gpu/bin/deps/cuda --test-threads 1
# Writes the random 1.5B-shape model once (single-threaded, ~a minute), then alternates.
BENCH_DEVICE=cuda BENCH_MODEL=random-1.5b BENCH_ROWS=1 BENCH_ITERS=1 \
    step verify-warm 200 gpu/bin/deps/verify
for rep in $(seq "${GPU_REPS:-2}"); do
    for variant in verify verify-stock; do
        [ -x gpu/bin/deps/$variant ] || continue
        BENCH_DEVICE=cuda BENCH_MODEL=random-1.5b BENCH_DTYPE=${GPU_DTYPE:-bf16} \
            BENCH_ROWS=1,5,9,17 BENCH_SEQS=64 BENCH_ITERS=20 \
            step "$variant-$rep" 90 gpu/bin/deps/$variant
    done
done
BENCH_TARGET_ARGS="--device cuda" BENCH_SESSIONS=${GPU_SESSIONS:-1,8,32,64} \
    BENCH_VARIANTS=target-only,auto,4 BENCH_BATCH=64 BENCH_CPUS=8-15,0-7 \
    step concurrency 280 gpu/bin/deps/concurrency
# Chains and a token tree of as many positions (5+3: issue 31), each output equal to target-only's.
BENCH_TARGET_ARGS="--device cuda" BENCH_RTT_MS=0,20 BENCH_MBIT=0 BENCH_VARIANTS=target-only,auto,8,5+3 \
    BENCH_REPS=${GPU_REPS:-3} BENCH_CPUS=8-15,0-7 step link 200 gpu/bin/deps/link
# The KV-cache budget a target-node on the GPU takes by default (80 % of the GPU's free memory once
# the model is loaded), against the memory the GPU has: gpu-memory.csv shows what the runs used.
kv() {
    local log=$out/kv-node.log addr
    gpu/bin/target-node --model "$TANDEM_QWEN_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
        --device cuda --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$log" 2>&1 &
    local node=$!
    for _ in $(seq 120); do grep -q '^listening' "$log" && break; sleep 0.5; done
    addr=$(grep -o 'http=[^ ]*' "$log" | cut -d= -f2)
    python3 -c "import urllib.request as u; print(u.urlopen('http://$addr/metrics').read().decode())" \
        | grep -E '^tandem_node_kv_cache|^tandem_node_prefix_cache_budget'
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    kill $node
}
export out && export -f kv
step kv 90 bash -c kv
# The real pair: the target's GGUF on the GPU (its weights dequantized to bf16, then to f16), the
# 0.5B draft on 8 pinned cores; every output checked equal to its prompt's lone target-only run.
BENCH_PAIRS=qwen-code BENCH_TARGET_ARGS="--device cuda" BENCH_SESSIONS=1,64 \
    BENCH_VARIANTS=target-only,1,4,8,auto BENCH_BATCH=64 BENCH_CPUS=8-15,0-7 \
    step qwen-bf16 240 gpu/bin/deps/concurrency
BENCH_PAIRS=qwen-code BENCH_TARGET_ARGS="--device cuda --dtype f16" BENCH_SESSIONS=1,64 \
    BENCH_VARIANTS=target-only,4,auto BENCH_BATCH=64 BENCH_CPUS=8-15,0-7 \
    step qwen-f16 180 gpu/bin/deps/concurrency
BENCH_PAIRS=qwen-prose,qwen-code BENCH_TARGET_ARGS="--device cuda" BENCH_RTT_MS=0,20 BENCH_MBIT=0 \
    BENCH_VARIANTS=target-only,auto,4,8 BENCH_REPS=2 BENCH_CPUS=8-15,0-7 step qlink 200 gpu/bin/deps/link
if case " $steps " in *" llamacpp "*) true ;; *) false ;; esac; then
    # llama.cpp's pack, carried whole or in pieces (llama.*, cut with split like the pair's).
    pack=gpu/llama.tar.xz
    [ -f $pack ] || pack=<(cat gpu/pieces/llama.*)
    rm -rf gpu/llama && xz -dc "$pack" | tar -C gpu -xf - || { echo "llama.cpp's pack is incomplete"; exit 1; }
    export LD_LIBRARY_PATH="$PWD/gpu/llama:$LD_LIBRARY_PATH"
    echo "llama.cpp $(cat gpu/llama/commit)" | tee "$out/llamacpp.txt"
    t=$TANDEM_QWEN_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    d=$TANDEM_QWEN_DIR/qwen2.5-coder-0.5b-instruct.gguf
    prompt=$(printf '<|im_start|>user\nRename `total` to `sum` in this function and return it:\n```python\ndef add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n```<|im_end|>\n<|im_start|>assistant\n')
    step llamacpp-bench 60 gpu/llama/llama-bench -m "$t" -ngl 99 -p 0,9 -n 64 -r 5
    for k in 4 8; do
        step "llamacpp-spec$k" 60 taskset -c 0-7 gpu/llama/llama-speculative -m "$t" -md "$d" \
            -ngl 99 -ngld 0 -td 8 --spec-draft-n-max $k --temp 0 -n 64 -p "$prompt"
    done
fi
