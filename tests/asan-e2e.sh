#!/usr/bin/env bash
# The end-to-end suite against an AddressSanitizer + UndefinedBehaviorSanitizer build of moed and
# its C tools (moectl, moed-load), in build-asan. Any report fails the run: a memory error or
# undefined behaviour aborts the process (which the suite's fixtures see as a bad exit), a leak at
# exit makes the exit status non-zero, and every report, from any process (also one whose exit
# status a test does not look at), is written under $BUILD_DIR/sanitizer-reports and printed
# here, failing the run even when every test passed.
#
#   tests/asan-e2e.sh [PYTEST ARGS...]      e.g. tests/asan-e2e.sh -x -k forward
#
# Environment: ASAN_BUILD_DIR (default build-asan), JOBS (default: the number of cores: the build's
# jobs and the suite's workers, tests/e2e/run.sh).
# CUDA is left out: there is no GPU to run it on in CI, and ASan's shadow memory and the CUDA
# driver's address-space reservations do not mix.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD_DIR=${ASAN_BUILD_DIR:-build-asan}
REPORTS="$PWD/$BUILD_DIR/sanitizer-reports"

cmake -S . -B "$BUILD_DIR" -DMOED_SANITIZE=ON -DMOED_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    >/dev/null || exit 1
cmake --build "$BUILD_DIR" -j"${JOBS:-$(nproc)}" || exit 1

rm -rf "$REPORTS"
mkdir -p "$REPORTS"
# abort_on_error: a report ends the process with SIGABRT (exit status 134 / -6), never 0.
# detect_leaks: LeakSanitizer at exit; a leak gives exit status 23.
export ASAN_OPTIONS="abort_on_error=1:halt_on_error=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="abort_on_error=1:halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan"
WORKERS="${JOBS:-$(nproc)}" MOED_BUILD_DIR="$PWD/$BUILD_DIR" bash tests/e2e/run.sh "$@"
rc=$?

shopt -s nullglob
reports=("$REPORTS"/*)
if [ ${#reports[@]} -gt 0 ]; then
    for f in "${reports[@]}"; do
        echo "=== sanitizer report $f"
        cat "$f"
    done
    echo "asan-e2e: ${#reports[@]} sanitizer report(s): FAILED" >&2
    exit 1
fi
[ $rc -eq 0 ] && echo "asan-e2e: the end-to-end suite passed with no sanitizer report"
exit $rc
