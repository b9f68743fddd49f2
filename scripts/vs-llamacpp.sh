#!/usr/bin/env bash
# Tandem against llama.cpp on this machine, the same GGUF files, the same threads (issue 33).
#
#   scripts/vs-llamacpp.sh
#
# 1. Finds llama.cpp (LLAMA_CPP: a checkout or source folder, built here if it has no
#    build/bin/llama-bench), or fetches the newest source (git clone of ggml-org/llama.cpp; where
#    git cannot reach GitHub, the copy vendored in the newest llama-cpp-python sdist on PyPI) into
#    ~/.cache/tandem/llama.cpp and builds it CPU-only (cmake from PATH, or from PyPI). Prints its
#    commit.
# 2. Target-only decode per tensor type, alternated round by round: llama-bench against
#    Tandem's decode on the same file (`cargo bench -p tandem-runtime --bench families`), on a
#    random-weight model of the stories110M shape in f32, f16, Q8_0, Q4_0, Q5_0, Q4_K_M and Q6_K,
#    and on the Qwen2.5-Coder pair's files where TANDEM_QWEN_DIR holds them (1.5B Q4_K_M, 0.5B
#    Q5_0 mix; scripts/fetch-qwen-pair.sh fetches them).
# 3. Speculative decoding, alternated round by round: llama-speculative against
#    `coordinator generate` (both nodes in one process), greedy and T = 0.8, K = 4 and 8, on the
#    110M-shape f32 target with its Q8_0 copy as the draft, and on the Qwen pair where present.
#
# Prints the CPU's model and flags, each side's median tokens/s and range, and the median of the
# per-round ratios (Tandem / llama.cpp).
#
# Environment: LLAMA_CPP (above), THREADS (default: every core), ROUNDS (3), TOKENS (decode, 64),
# SPEC_TOKENS (speculative, 128), KS ("4 8"), TEMPS ("0 0.8"), PARTS ("decode spec"),
# TANDEM_QWEN_DIR, BENCH_DIR (scratch; default ~/.cache/tandem/vs-llamacpp), ISA (avx2, avx512
# or avx512_vnni: both sides held to those vector extensions, as on a CPU that has no more —
# llama.cpp built with them alone in build-$ISA, Tandem run with TANDEM_MAX_CPU_ISA=$ISA;
# default: everything this CPU has).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
work=${BENCH_DIR:-$cache/vs-llamacpp}
threads=${THREADS:-$(nproc)}
rounds=${ROUNDS:-3}
tokens=${TOKENS:-64}
spec_tokens=${SPEC_TOKENS:-128}
ks=${KS:-4 8}
temps=${TEMPS:-0 0.8}
parts=${PARTS:-decode spec}
isa=${ISA:-}
case "$isa" in
    "" | avx2 | avx512 | avx512_vnni) ;;
    *) echo "ISA=$isa: avx2, avx512 or avx512_vnni" >&2; exit 2 ;;
esac
export TANDEM_MAX_CPU_ISA=${isa:-}
[ -n "$isa" ] || unset TANDEM_MAX_CPU_ISA
qwen=${TANDEM_QWEN_DIR:-$cache/models}
mkdir -p "$work"

say() { printf '%s\n' "$*" >&2; }

# cmake from PATH, or from PyPI into a venv of the cache.
find_cmake() {
    if command -v cmake >/dev/null; then
        command -v cmake
        return
    fi
    if [ ! -x "$cache/cmake-venv/bin/cmake" ]; then
        say "cmake: installing it from PyPI into $cache/cmake-venv"
        python3 -m venv "$cache/cmake-venv"
        "$cache/cmake-venv/bin/pip" install -q cmake
    fi
    echo "$cache/cmake-venv/bin/cmake"
}

# The newest llama.cpp source a user can get: GitHub, else the PyPI sdist's vendored copy.
fetch_llama() {
    local src=$1
    if git clone -q --depth 1 https://github.com/ggml-org/llama.cpp "$src" 2>/dev/null; then
        git -C "$src" log -1 --format='ggml-org/llama.cpp %h (%cs), git clone' >"$src/.tandem-source"
        return
    fi
    say "GitHub unreachable: llama.cpp as vendored by the newest llama-cpp-python sdist on PyPI"
    local tmp
    tmp=$(mktemp -d)
    # The sdist straight from PyPI's JSON API (pip would build its metadata, cmake included).
    python3 - "$tmp" <<'EOF'
import json, sys, urllib.request
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-python/json"))
sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
url = urllib.request.urljoin("https://pypi.org/pypi/llama-cpp-python/json", sdist["url"])
urllib.request.urlretrieve(url, f"{sys.argv[1]}/{sdist['filename']}")
EOF
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    local pkg
    pkg=$(ls -d "$tmp"/llama_cpp_python-*/)
    mv "$pkg/vendor/llama.cpp" "$src"
    # The sdist has no git history: its changelog names the commit it vendors.
    local commit
    commit=$(grep -o -m1 'llama.cpp@[0-9a-f]*' "$pkg/CHANGELOG.md" | cut -d@ -f2)
    echo "ggml-org/llama.cpp $commit, vendored by $(basename "$pkg")" >"$src/.tandem-source"
    rm -rf "$tmp"
}

# Whether extensions of level $1 (avx2, avx512, avx512_vnni) are within ISA.
within() {
    local order="avx2 avx512 avx512_vnni" cap=${isa:-avx512_vnni}
    local rest=${order#*"$cap"}
    [[ " ${order%"$rest"} " == *" $1 "* ]]
}

llama_bin() {
    local src=${LLAMA_CPP:-$cache/llama.cpp}
    if [ ! -d "$src" ]; then
        fetch_llama "$src"
    fi
    local build=$src/build${isa:+-$isa}
    local bin=$build/bin
    if [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/llama-speculative" ]; then
        local cmake
        cmake=$(find_cmake)
        say "building llama.cpp in $build (CPU only; about 6 minutes on 2 cores)"
        # This CPU's vector extensions up to ISA's, AMX left out: a virtual machine may list
        # AMX and still refuse its tiles (a native build's llama-speculative died of SIGILL on
        # its first batch on such a machine, while llama-bench's one-token decode ran). A
        # build without GGML_NATIVE turns AVX, AVX2, BMI2, FMA and F16C on by itself.
        local flags=() entry
        for entry in avx2:AVX2:avx2 fma:FMA:avx2 f16c:F16C:avx2 avx512f:AVX512:avx512 \
            avx512vbmi:AVX512_VBMI:avx512 avx512_vnni:AVX512_VNNI:avx512_vnni \
            avx512_bf16:AVX512_BF16:avx512_vnni; do
            IFS=: read -r flag option level <<<"$entry"
            if grep -q -w "$flag" /proc/cpuinfo && within "$level"; then
                flags+=("-DGGML_$option=ON")
            fi
        done
        "$cmake" -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            "${flags[@]}" -DLLAMA_CURL=OFF -DGGML_CUDA=OFF >/dev/null
        "$cmake" --build "$build" -j "$(nproc)" --target llama-bench llama-speculative \
            >/dev/null
    fi
    echo "$bin"
}

llama_source() {
    local src=${LLAMA_CPP:-$cache/llama.cpp}
    if [ -f "$src/.tandem-source" ]; then
        cat "$src/.tandem-source"
    elif git -C "$src" rev-parse --short HEAD >/dev/null 2>&1; then
        git -C "$src" log -1 --format='ggml-org/llama.cpp %h (%cs)'
    else
        echo "llama.cpp at $src (commit unknown)"
    fi
}

# "median (min–max)" of the numbers on stdin.
spread() {
    sort -g | awk '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%.1f (%.1f–%.1f)", m, v[1], v[NR] }'
}

# The spread of field $1 of the other arguments ("tokens/s accepted%" each).
column() {
    local field=$1
    shift
    printf '%s\n' "$@" | cut -d' ' -f"$field" | spread
}

median() {
    sort -g | awk '{ v[NR] = $1 } END {
        printf "%.2f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

bin=$(llama_bin)
say "building Tandem (release)"
(cd "$repo" && cargo build -q --release -p tandem-coordinator)
coordinator=$repo/target/release/coordinator

echo "# Tandem against llama.cpp, $(date -u +%F)"
echo
echo "- CPU: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(nproc) cores; flags:" \
    "$(grep -o -w -E 'avx2|fma|f16c|avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "- llama.cpp: $(llama_source), CPU-only build ($bin)"
echo "- Tandem: $(git -C "$repo" rev-parse --short HEAD)"
echo "- threads: $threads each side; $rounds rounds, alternated"
[ -z "$isa" ] || echo "- both held to $isa: llama.cpp built with its extensions alone," \
    "Tandem run with TANDEM_MAX_CPU_ISA=$isa"

qwen_target=$qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
qwen_draft=$qwen/qwen2.5-coder-0.5b-instruct.gguf
families=$work/tandem-bench-families

if [[ " $parts " == *" decode "* ]]; then
    own=""
    [ -f "$qwen_target" ] && own="$qwen_target,$qwen_draft"
    echo
    echo "## Target-only decode, $tokens tokens (llama-bench -p 0 -n $tokens against Tandem's decode)"
    echo
    (cd "$repo" && TMPDIR=$work LLAMA_BENCH=$bin/llama-bench BENCH_FAMILIES=llama \
        BENCH_TYPES=f32,f16,q8_0,q4_0,q5_0,q4_k_m,q6_k BENCH_GGUF=$own BENCH_ROUNDS=$rounds \
        BENCH_TOKENS=$tokens BENCH_THREADS=$threads RAYON_NUM_THREADS=$threads \
        CANDLE_NUM_THREADS=$threads cargo bench -q -p tandem-runtime --bench families 2>/dev/null |
        grep -e '^|' -e '^- ')
fi

# One llama-speculative run: "tokens/s accepted%". Plain temperature sampling, as Tandem's
# defaults (llama.cpp's own defaults truncate with top-k 40, top-p 0.95, min-p 0.05).
llama_spec() {
    local target=$1 draft=$2 prompt=$3 k=$4 temp=$5 seed=$6 out
    out=$("$bin/llama-speculative" -m "$target" -md "$draft" -p "$prompt" -n "$spec_tokens" \
        -t "$threads" -td "$threads" --spec-draft-n-max "$k" --temp "$temp" --seed "$seed" \
        --top-k 0 --top-p 1 --min-p 0 \
        --ignore-eos -c 2048 2>&1) || { say "$out"; return 1; }
    local speed accept
    speed=$(sed -n 's/.*speed: *\([0-9.]*\) t\/s.*/\1/p' <<<"$out" | tail -1)
    accept=$(sed -n 's/.*accept *= *\([0-9.]*\)%.*/\1/p' <<<"$out" | tail -1)
    echo "$speed $accept"
}

# One `coordinator generate` run (both nodes in this process): "tokens/s accepted%".
tandem_spec() {
    local target=$1 draft=$2 prompt=$3 k=$4 temp=$5 seed=$6
    RAYON_NUM_THREADS=$threads CANDLE_NUM_THREADS=$threads "$coordinator" generate \
        --target-model "$target" --draft-model "$draft" --prompt "$prompt" \
        --max-tokens "$spec_tokens" --draft-tokens "$k" --temperature "$temp" --seed "$seed" \
        --ignore-eos --no-baseline --json 2>/dev/null |
        sed -n 's/.*"acceptance_rate":\([0-9.e+-]*\).*"tokens_per_second":\([0-9.e+-]*\).*/\2 \1/p' |
        awk '{ print $1, 100 * $2 }'
}

if [[ " $parts " == *" spec "* ]]; then
    pairs=()
    if [ -f "$families/llama-f32.gguf" ] && [ -f "$families/llama-q8_0.gguf" ]; then
        pairs+=("110M-shape f32 / Q8_0|$families/llama-f32.gguf|$families/llama-q8_0.gguf|Once upon a time")
    else
        say "no 110M-shape files in $families: run the decode part first (PARTS=\"decode spec\")"
    fi
    if [ -f "$qwen_target" ] && [ -f "$qwen_draft" ]; then
        pairs+=("Qwen2.5-Coder 1.5B Q4_K_M / 0.5B|$qwen_target|$qwen_draft|def quicksort(items):")
    fi
    echo
    echo "## Speculative decoding, $spec_tokens tokens (llama-speculative --spec-draft-n-max K against coordinator generate --draft-tokens K)"
    echo
    echo "| pair | K | T | llama.cpp tok/s | accepted | Tandem tok/s | accepted | Tandem / llama.cpp (median) |"
    echo "|---|---|---|---|---|---|---|---|"
    for pair in "${pairs[@]}"; do
        IFS='|' read -r name target draft prompt <<<"$pair"
        for temp in $temps; do
            for k in $ks; do
                theirs=() ours=()
                for r in $(seq "$rounds"); do
                    theirs+=("$(llama_spec "$target" "$draft" "$prompt" "$k" "$temp" "$r")")
                    ours+=("$(tandem_spec "$target" "$draft" "$prompt" "$k" "$temp" "$r")")
                done
                ratios=$(for i in "${!ours[@]}"; do
                    awk -v a="${ours[$i]%% *}" -v b="${theirs[$i]%% *}" 'BEGIN { print a / b }'
                done | median)
                echo "| $name | $k | $temp | $(column 1 "${theirs[@]}") |" \
                    "$(column 2 "${theirs[@]}") % | $(column 1 "${ours[@]}") |" \
                    "$(column 2 "${ours[@]}") % | $ratios |"
            done
        done
    done
fi
