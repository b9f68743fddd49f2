#!/usr/bin/env bash
# Builds Tandem with --features cuda on a machine with no CUDA toolkit and no GPU: nvcc 13.0 (its
# compiler pieces pinned to 13.0 too: a newer cicc writes PTX that 13.0's ptxas and a 580 driver
# refuse) and
# the CUDA libraries come from their PyPI wheels, and a stub libcuda.so (the driver's entry
# points, read from cuda.h) stands in for the driver at link time; the real one is loaded where
# the binaries run.
#
#   scripts/build-cuda.sh [CARGO BUILD/TEST ARGS]   e.g. scripts/build-cuda.sh --release --bins
#   scripts/build-cuda.sh --check [CARGO CHECK ARGS]
#       type-checks the CUDA path (`cargo check --features cuda`, nvcc compiling candle's kernels
#       as the build does) in the caller's target directory, nothing linked, and compiles
#       Tandem's own kernel (runtime/src/kernels/attention.cu, which the binaries compile with
#       NVRTC where they run) with nvcc: what the test suite runs (tests/tests/cuda_build.rs).
#
# Environment: CUDA_COMPUTE_CAP (default 90: H100/H200), CUDA_ENV (where the wheels go, default
# target/cuda-env), CARGO_TARGET_DIR (default target/cuda). Prints the environment it used, so
# that `cargo test --features cuda --no-run` can be run the same way:
#   eval "$(scripts/build-cuda.sh --print-env)"
set -euo pipefail
cd "$(dirname "$0")/.."

: "${CUDA_COMPUTE_CAP:=90}"
: "${CUDA_ENV:=$PWD/target/cuda-env}"
: "${CARGO_TARGET_DIR:=$PWD/target/cuda}"
root="$CUDA_ENV/root"

cu() { echo "$CUDA_ENV"/venv/lib/python3*/site-packages/nvidia/cu13; }
# The compiler and the headers (all a check needs), then the libraries a build links.
if [ ! -x "$root/bin/nvcc" ]; then
    python3 -m venv "$CUDA_ENV/venv"
    "$CUDA_ENV/venv/bin/pip" install -q "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
        "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
    mkdir -p "$root/lib64"
    ln -sfn "$(cu)/include" "$root/include"
    ln -sfn "$(cu)/bin" "$root/bin"
fi
if [ "${1:-}" != "--check" ] && [ ! -e "$root/lib64/libcublas.so" ]; then
    "$CUDA_ENV/venv/bin/pip" install -q "nvidia-cublas==13.0.*" "nvidia-curand" \
        "nvidia-cuda-nvrtc==13.0.*"
    for lib in cublas cublasLt cudart nvrtc; do
        ln -sf "$(cu)/lib/lib$lib.so.13" "$root/lib64/lib$lib.so"
    done
    ln -sf "$(cu)/lib/libcurand.so.10" "$root/lib64/libcurand.so"
    # The driver's entry points, each an empty function: enough to link, never run.
    grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$(cu)/include/cuda.h" | sort -u \
        | awk '{print "void " $1 "(void){}"}' >"$CUDA_ENV/libcuda-stub.c"
    cc -shared -fPIC -o "$root/lib64/libcuda.so" -Wl,-soname,libcuda.so.1 "$CUDA_ENV/libcuda-stub.c"
fi

env_lines() {
    echo "export CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CUDA_ROOT=$root CUDA_PATH=$root"
    echo "export CARGO_TARGET_DIR=$CARGO_TARGET_DIR PATH=$root/bin:\$PATH"
    echo "export LIBRARY_PATH=$root/lib64 RUSTFLAGS='-L $root/lib64'"
}
if [ "${1:-}" = "--print-env" ]; then
    env_lines
    exit 0
fi
if [ "${1:-}" = "--check" ]; then
    shift
    export CUDA_COMPUTE_CAP CUDA_ROOT="$root" CUDA_PATH="$root" PATH="$root/bin:$PATH"
    cargo check --features cuda "$@"
    ptx=$(mktemp -d)
    trap 'rm -rf "$ptx"' EXIT
    nvcc --ptx -arch="sm_$CUDA_COMPUTE_CAP" -o "$ptx/attention.ptx" runtime/src/kernels/attention.cu
    echo "nvcc: runtime/src/kernels/attention.cu compiles for sm_$CUDA_COMPUTE_CAP"
    exit 0
fi
eval "$(env_lines)"
cargo build --features cuda "$@"
