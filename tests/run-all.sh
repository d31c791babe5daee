#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it: install what is missing, build, unit tests
# (ctest: the C units, and the GPU tests where CUDA is built, which report themselves skipped
# without a GPU), the end-to-end tests against real moed processes, the Python client's own tests,
# moed-load's HTML report rendered in a headless browser, the deployment files' checks, bounded
# fuzzing runs over what comes from outside (requests, the
# metrics endpoint's HTTP, safetensors headers, .npy files), and the end-to-end
# suite again against an ASan/UBSan build.
#
#   tests/run-all.sh               every stage in order
#   tests/run-all.sh unit e2e      only the named stages (the build must exist)
#
# Each stage is one function, stage_NAME, listed in STAGES; add a stage by writing its function and
# naming it there. Setup stages (deps, build, client) stop the run when they fail, since nothing
# after them can run; a failing test stage is recorded and the others still run, so one run shows
# every failure. The exit status is 0 only when every stage passed.
#
# Environment: BUILD_DIR (default build), JOBS (default: the number of cores: the build's jobs and
# the end-to-end suites' workers, tests/e2e/run.sh), CMAKE_ARGS (extra arguments for the configure
# step, e.g. -DMOED_WITH_CUDA=OFF), PYTEST_ARGS (extra pytest arguments, e.g. "-x -k forward").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
PY=.venv/bin/python
STAGES=(deps format build client unit e2e python report deploy fuzz asan)
SETUP_STAGES=" deps build client "

stage_deps() {
    bash deploy/install-deps.sh
}

stage_format() {
    # Every C and CUDA source as the committed .clang-format has it (the style standard).
    command -v clang-format >/dev/null || {
        sudo=""
        [ "$(id -u)" -eq 0 ] || sudo=sudo
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang-format
    }
    git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
}

stage_build() {
    # shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
    cmake -S . -B "$BUILD_DIR" ${CMAKE_ARGS:-} >/dev/null &&
        cmake --build "$BUILD_DIR" -j"$JOBS"
}

# Under `make test` the build's own make would inherit make's flags and print "Entering directory"
# around every step; the build is not part of the outer make's job server anyway.
unset MAKEFLAGS MFLAGS MAKELEVEL

stage_client() {
    # Reinstalled every run, so the tests never use stubs generated from an older proto; with the
    # build's libmoedclient packaged (the doorbell's), not one built again for the package.
    local lib="$PWD/$BUILD_DIR/client/c/libmoedclient.so"
    [ -f "$lib" ] || lib=""
    MOED_CLIENT_LIB=$lib .venv/bin/pip install -q --no-build-isolation --force-reinstall --no-deps ./client/python
}

stage_unit() {
    if ! ctest --test-dir "$BUILD_DIR" -N | grep test_cuda_backend >/dev/null; then  # not -q: SIGPIPE
        echo "note: no GPU tests: this build has no CUDA backend (no nvcc at configure time, or -DMOED_WITH_CUDA=OFF)"
    fi
    # ctest lists a test that exits 77 (no GPU) as "Skipped", and again under "did not run".
    # --no-tests=error: a build that lost its tests must not pass as one whose tests all passed.
    ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j"$JOBS"
}

stage_e2e() {
    # JOBS processes side by side, then the tests that must run alone (tests/e2e/run.sh).
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    WORKERS="$JOBS" MOED_BUILD_DIR="$PWD/$BUILD_DIR" bash tests/e2e/run.sh ${PYTEST_ARGS:-}
}

stage_python() {
    # shellcheck disable=SC2086
    $PY -m pytest -q -rfEsxX -p no:cacheprovider client/python/tests ${PYTEST_ARGS:-}
}

stage_report() {
    # moed-load's --report page opened in Debian's chromium. The browser is this stage's own
    # dependency, installed here on first use (not by install-deps.sh: make demo needs none).
    command -v chromium >/dev/null || {
        sudo=""
        [ "$(id -u)" -eq 0 ] || sudo=sudo
        echo "report: installing chromium"
        $sudo apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium
    } || return 1
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    MOED_BUILD_DIR="$PWD/$BUILD_DIR" $PY -m pytest -q -rfEsxX -p no:cacheprovider tests/report ${PYTEST_ARGS:-}
}

stage_deploy() {
    # systemd unit (systemd-analyze verify), container file rules, Kubernetes manifests, moed.conf.
    BUILD_DIR="$BUILD_DIR" bash tests/deploy-check.sh
}

stage_fuzz() {
    # libFuzzer over what comes from outside: Forward requests, the metrics endpoint's HTTP, the
    # safetensors header, .npy files, --expert-load files; bounded (FUZZ_SECONDS, default 60, for
    # the first; half or a quarter each for the others: tests/fuzz/run.sh).
    bash tests/fuzz/run.sh "${FUZZ_SECONDS:-60}"
}

stage_asan() {
    # The end-to-end suite against an ASan/UBSan build (build-asan); any sanitizer report fails.
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    JOBS="$JOBS" bash tests/asan-e2e.sh ${PYTEST_ARGS:-}
}

# A failed stage's failing tests, named again under the summary: a CI log that keeps only its tail
# still says which test failed, not just which stage.
failure_lines() {
    local lines
    lines=$(grep -E '^(FAILED|ERROR) |\*\*\*(Failed|Exception|Timeout)|SUMMARY: ' "$1" | head -20)
    [ -n "$lines" ] || lines=$(tail -n 10 "$1")
    printf '%s\n' "$lines"
}

run_stage() {
    local name=$1 start=$SECONDS rc log=$logdir/$1.log
    echo
    echo "=== $name"
    "stage_$name" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    results+=("$(printf '%-8s %-6s %4ds' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAILED)" $((SECONDS - start)))")
    [ $rc -eq 0 ] || failures+=("--- $name" "$(failure_lines "$log")")
    return $rc
}

main() {
    local stages=("$@") failed=0 s
    [ ${#stages[@]} -gt 0 ] || stages=("${STAGES[@]}")
    for s in "${stages[@]}"; do
        if ! declare -F "stage_$s" >/dev/null; then
            echo "run-all: unknown stage '$s'; the stages are: ${STAGES[*]}" >&2
            return 2
        fi
    done
    results=() failures=()
    logdir=$(mktemp -d)
    trap 'rm -rf "$logdir"' EXIT
    for s in "${stages[@]}"; do
        if ! run_stage "$s"; then
            failed=1
            if [[ $SETUP_STAGES == *" $s "* ]]; then
                echo "run-all: stage '$s' failed; the stages after it cannot run" >&2
                break
            fi
        fi
    done
    echo
    echo "=== summary"
    printf '%s\n' "${results[@]}"
    [ ${#failures[@]} -eq 0 ] || printf '%s\n' "${failures[@]}"
    [ $failed -eq 0 ] && echo "all stages passed" || echo "some stages FAILED"
    return $failed
}

main "$@"
