#!/usr/bin/env bash
# Builds the fuzzers with clang (-fsanitize=fuzzer,address,undefined) and runs each for a bounded
# time; exits non-zero if one finds a crash, a sanitizer report or a broken invariant.
#
#   tests/fuzz/run.sh [SECONDS]        default 60: fuzz_request runs SECONDS, region, ring, link
#                                      and expert_load a quarter of it, the others half
#
# The targets — everything that reaches moed from outside and is parsed before anything else:
#   fuzz_request       a Forward request's decoding and validation (server/wire.c, request.c),
#                      region references included (server/region.c)
#   fuzz_region        a Regions stream's commands (server/region_cmd.c, wire.c, region.c,
#                      doorbell.c's rings, link.c's links: off here, so refused)
#   fuzz_ring          a doorbell ring's header check and call descriptors as the poller takes
#                      them (common/moed_ring.c, server/request.c)
#   fuzz_link          an NCCL link's messages as its thread receives them (server/link.c,
#                      common/moed_link.c, server/request.c) over faked links
#   fuzz_http          the metrics endpoint's request parser (server/http_parse.c)
#   fuzz_safetensors   a checkpoint file's header (server/safetensors.c)
#   fuzz_npy           the .npy files moectl and moed-load read (client/c/npy.c)
#   fuzz_expert_load   --expert-load's Prometheus text (server/expert_load.c)
#
# Environment: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_JOBS (parallel fuzzing processes per
# target, default 1), FUZZ_PARALLEL (targets run at once, default the number of cores),
# FUZZ_TARGETS (default all nine). Each target's working corpus persists in
# $FUZZ_BUILD_DIR/corpus-NAME between runs (it starts from the seeds make_seeds.py writes); a
# crashing input is saved as $FUZZ_BUILD_DIR/artifacts/NAME-crash-* and reproduces with
# `$FUZZ_BUILD_DIR/NAME FILE`.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
build=${FUZZ_BUILD_DIR:-build-fuzz}
jobs=${FUZZ_JOBS:-1}
targets=(${FUZZ_TARGETS:-request region ring link http safetensors npy expert_load})

# clang and libFuzzer's runtime (libclang-rt-14-dev on Debian 12) if missing.
if ! command -v clang >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "fuzz: installing clang and libclang-rt-dev"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-dev
fi

incs=(-Iserver -Iclient/c/cli -Icommon -Ikernels -I"$build/proto")

# The protocol's protobuf-c code (region commands are decoded with it).
mkdir -p "$build/proto"
protoc-c --c_out="$build/proto" -I proto proto/moed/v1/moed.proto

# Each target's sources beyond tests/fuzz/fuzz_NAME.c, and its libraries. (Not through CMake: the
# CPU GEMM's feature checks need a newer clang than Debian 12's, and the fuzzers need none of it.)
sources_request() {
    echo server/wire.c server/request.c server/shard.c server/region.c server/guard.c server/bufpool.c
    echo kernels/moed_backend.c common/*.c
}
libs_request() { pkg-config --cflags --libs grpc libprotobuf-c; }
sources_region() {
    echo server/region_cmd.c server/region.c server/wire.c server/guard.c server/log.c
    echo server/doorbell.c server/link.c server/request.c server/scheduler.c server/metrics.c
    echo server/shard.c server/bufpool.c "$build/proto/moed/v1/moed.pb-c.c" kernels/moed_backend.c
    echo common/*.c
}
libs_region() { pkg-config --cflags --libs grpc libprotobuf-c; }
sources_ring() {
    echo server/request.c server/wire.c server/shard.c server/region.c server/guard.c
    echo server/bufpool.c kernels/moed_backend.c common/*.c
}
libs_ring() { pkg-config --cflags --libs grpc libprotobuf-c; }
sources_link() {
    echo server/link.c server/request.c server/wire.c server/shard.c server/region.c server/guard.c
    echo server/bufpool.c server/scheduler.c server/metrics.c server/log.c kernels/moed_backend.c
    echo common/*.c
}
libs_link() { echo -Itests/unit; pkg-config --cflags --libs grpc libprotobuf-c; }
# Inputs up to 8 KiB reach every field and limit of a request, a header and a .npy; an HTTP head
# is refused past 8 KiB, so its inputs go a little further.
maxlen() { [ "$1" = http ] && echo 10240 || echo 8192; }
sources_http() { echo server/http_parse.c; }
libs_http() { :; }
sources_safetensors() {
    echo server/safetensors.c server/file.c common/moed_err.c common/moed_dtype.c
}
libs_safetensors() { pkg-config --cflags --libs libcjson; }
sources_npy() {
    echo client/c/cli/npy.c common/moed_err.c common/moed_dtype.c
}
libs_npy() { :; }
sources_expert_load() { echo server/expert_load.c server/file.c common/moed_err.c; }
libs_expert_load() { echo -lm; }

mkdir -p "$build/artifacts"
py=.venv/bin/python
[ -x "$py" ] || py=python3
san="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# One target: built, seeded and run for its share of the time; its output into $build/log-NAME
# and its result into $build/rc-NAME (0: no crash).
fuzz_one() {
    local t=$1 name=fuzz_$1 seeds run rc=0
    # shellcheck disable=SC2046,SC2086
    clang -O1 -g $san -std=c11 -D_GNU_SOURCE -Wall -Wextra \
        -Wno-unused-parameter "${incs[@]}" "tests/fuzz/$name.c" $(sources_$t) $(libs_$t) \
        -lpthread -lm -o "$build/$name" || { echo 1 >"$build/rc-$t"; return; }
    seeds="$build/seeds-$t"
    rm -rf "$seeds"
    "$py" tests/fuzz/make_seeds.py "$t" "$seeds"
    mkdir -p "$build/corpus-$t"
    run=$secs
    [ "$t" = request ] || run=$((secs / 2))
    [ "$t" = region ] && run=$((secs / 4))
    [ "$t" = ring ] && run=$((secs / 4))
    [ "$t" = link ] && run=$((secs / 4))
    [ "$t" = expert_load ] && run=$((secs / 4))
    echo "fuzz: running $name for ${run}s (jobs=$jobs)"
    # -timeout: one input must never take seconds; a leak is a failure too (detect_leaks is on
    # under libFuzzer by default); -error_exitcode: 1, not libFuzzer's 77, which test runners
    # read as "skipped".
    local args=(-max_total_time="$run" -max_len="$(maxlen "$t")" -timeout=10 -rss_limit_mb=2048
        -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$build/artifacts/$t-"
        -print_final_stats=1)
    if [ "$jobs" -gt 1 ]; then
        args+=(-jobs="$jobs" -workers="$jobs")
    fi
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=abort_on_error=1 \
        "$build/$name" "${args[@]}" "$build/corpus-$t" "$seeds" || rc=$?
    if [ $rc -ne 0 ]; then
        echo "fuzz: $name FAILED (exit $rc): the input is in $build/artifacts/; reproduce with" \
            "$build/$name $build/artifacts/$t-FILE"
    else
        echo "fuzz: $name: no crash in ${run}s; corpus: $(find "$build/corpus-$t" -type f | wc -l) inputs"
    fi
    echo $rc >"$build/rc-$t"
}

# The targets run side by side, as many at a time as there are cores (FUZZ_PARALLEL), each
# fuzzing process single-threaded: on CI's two cores the stage takes about half the time of one
# after the other. Each target's output is printed whole once it ends.
par=${FUZZ_PARALLEL:-$(nproc)}
failed=0
running=0
for t in "${targets[@]}"; do
    rm -f "$build/rc-$t"
    fuzz_one "$t" >"$build/log-$t" 2>&1 &
    running=$((running + 1))
    if [ "$running" -ge "$par" ]; then
        wait -n || true
        running=$((running - 1))
    fi
done
wait || true
for t in "${targets[@]}"; do
    cat "$build/log-$t"
    [ "$(cat "$build/rc-$t" 2>/dev/null)" = 0 ] || failed=1
done
exit $failed
