#!/usr/bin/env bash
# `make demo`: from a fresh checkout to answers from a running moed, in one command.
#
# Installs what is missing (deploy/install-deps.sh), builds (cmake, build/), installs the Python
# client into .venv, starts moed with its default synthetic model on a free loopback port, calls
# it from Python (client/demo.py) and from C (moectl), prints what came back — shapes, the first
# values, the largest error against the float64 numpy reference, timings — and stops it with
# SIGTERM, which must end in exit status 0. Any failure stops the demo with a non-zero status.
#
# Environment: BUILD_DIR (default build), JOBS (default: the number of cores), CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
unset MAKEFLAGS MFLAGS MAKELEVEL # the build's make is not part of an outer make (make demo)
JOBS=${JOBS:-$(nproc)}
step() { printf '\n== %s\n' "$*"; }

step "installing what is missing (deploy/install-deps.sh)"
bash deploy/install-deps.sh

step "building (cmake, $BUILD_DIR/)"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S . -B "$BUILD_DIR" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS" --target moed moectl
MOED=$BUILD_DIR/server/moed
MOECTL=$BUILD_DIR/client/c/moectl
if [ ! -x "$MOED" ] || [ ! -x "$MOECTL" ]; then
    echo "demo: the build did not produce $MOED and $MOECTL" >&2
    exit 1
fi

step "installing the Python client into .venv"
.venv/bin/pip install -q --no-build-isolation --no-deps --force-reinstall ./client/python

work=$(mktemp -d)
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr=127.0.0.1:$port
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

step "starting moed on $addr with the default synthetic model (log: $work/moed.log)"
"$MOED" --listen "$addr" >"$work/moed.log" 2>&1 &
pid=$!
t0=$(date +%s%N)
until "$MOECTL" --target "$addr" --timeout 1 health >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { cat "$work/moed.log"; echo "demo: moed exited before serving" >&2; exit 1; }
    sleep 0.1
done
echo "SERVING after $((($(date +%s%N) - t0) / 1000000)) ms"
grep 'msg="ready"' "$work/moed.log" || true

step "calling it from Python (client/demo.py)"
.venv/bin/python client/demo.py python "$addr" "$work"

step "calling it from C (moectl)"
"$MOECTL" --target "$addr" health
"$MOECTL" --target "$addr" info
"$MOECTL" --target "$addr" forward --layer 0 --hidden "$work/x.npy" --ids "$work/ids.npy" \
    --weights "$work/w.npy" --out "$work/y_c.npy"
.venv/bin/python client/demo.py c "$work"

step "stopping moed (SIGTERM)"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=
tail -n 3 "$work/moed.log"
echo "moed exited with status $rc"
[ "$rc" -eq 0 ] || { echo "demo: moed must exit 0 after SIGTERM" >&2; exit 1; }
echo
echo "demo finished: moed answered the Python and the C client, within tolerance of the reference"
