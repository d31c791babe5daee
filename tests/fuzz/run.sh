#!/usr/bin/env bash
# Builds the request-decoding fuzzer with clang (-fsanitize=fuzzer,address,undefined) and runs it
# for a bounded time; exits non-zero if it finds a crash, a sanitizer report or a broken invariant.
#
#   tests/fuzz/run.sh [SECONDS]        default 60
#
# Environment: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_JOBS (parallel fuzzing processes,
# default 1). The working corpus persists in $FUZZ_BUILD_DIR/corpus between runs (it starts from
# the seeds that make_seeds.py writes); a crashing input is saved as
# $FUZZ_BUILD_DIR/artifacts/crash-* and reproduces with `$FUZZ_BUILD_DIR/fuzz_request FILE`.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
build=${FUZZ_BUILD_DIR:-build-fuzz}
jobs=${FUZZ_JOBS:-1}

# clang and libFuzzer's runtime (libclang-rt-14-dev on Debian 12) if missing.
if ! command -v clang >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "fuzz: installing clang and libclang-rt-dev"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-dev
fi

# What a Forward call runs before queueing (wire.c, request.c) and the kernels' modules they and
# the synthetic layers need, compiled with libFuzzer's coverage hooks and sanitizers in one go.
# (Not through CMake: the CPU GEMM's feature checks need a newer clang than Debian 12's, and the
# fuzzer needs none of it.)
mkdir -p "$build"
san="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# shellcheck disable=SC2046,SC2086
clang -O1 -g $san -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter \
    -Iserver -Ikernels/core -Ikernels tests/fuzz/fuzz_request.c server/wire.c server/request.c \
    kernels/core/*.c \
    $(pkg-config --cflags --libs grpc libprotobuf-c) -lpthread -lm -o "$build/fuzz_request"

seeds="$build/seeds"
rm -rf "$seeds"
py=.venv/bin/python
[ -x "$py" ] || py=python3
"$py" tests/fuzz/make_seeds.py "$seeds"
mkdir -p "$build/corpus" "$build/artifacts"

echo "fuzz: running fuzz_request for ${secs}s (jobs=$jobs)"
# -max_len: requests up to 8 KiB reach every field and limit; -timeout: one input must never take
# seconds; a leak is a failure too (detect_leaks is on under libFuzzer by default).
# -error_exitcode: 1, not libFuzzer's 77, which test runners read as "skipped".
args=(-max_total_time="$secs" -max_len=8192 -timeout=10 -rss_limit_mb=2048
      -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$build/artifacts/" -print_final_stats=1)
if [ "$jobs" -gt 1 ]; then
    args+=(-jobs="$jobs" -workers="$jobs")
fi
rc=0
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=abort_on_error=1 \
    "$build/fuzz_request" "${args[@]}" "$build/corpus" "$seeds" || rc=$?
if [ $rc -ne 0 ]; then
    echo "fuzz: FAILED (exit $rc): the input is in $build/artifacts/; reproduce with" \
        "$build/fuzz_request $build/artifacts/FILE" >&2
    exit 1
fi
echo "fuzz: no crash in ${secs}s; corpus: $(find "$build/corpus" -type f | wc -l) inputs"
