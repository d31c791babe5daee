#!/usr/bin/env bash
# A concurrency sweep for each T and transport against one moed, drawn on one moed-load --report
# page, and (where chromium is installed) a screenshot of it: what `make report` runs.
#
#   bench/daemon/sweep_report.sh          a synthetic moed started here on loopback, stopped after
#   TARGET=gpu-host:50051 METRICS=gpu-host:8464 TRANSPORTS=inline bench/daemon/sweep_report.sh
#
# Environment: TARGET (default: start build/server/moed with SPEC), METRICS (its --metrics-listen,
# for the per-expert heat map as the daemon counted it), TOKENS (default "8 64"), TRANSPORTS
# (default "inline shm"; shm reaches a daemon on this host only), CONCURRENCY (default 1:16:5),
# DURATION (seconds per level, default 2), OUT (default build/report), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${BUILD_DIR:-build}
OUT=${OUT:-$BUILD_DIR/report}
TOKENS=${TOKENS:-8 64}
TRANSPORTS=${TRANSPORTS:-inline shm}
CONCURRENCY=${CONCURRENCY:-1:16:5}
DURATION=${DURATION:-2}
SPEC=${SPEC:-layers=2,d=512,ff=1024,experts=16,topk=2,dtype=bf16}
LOAD=$BUILD_DIR/client/c/moed-load
mkdir -p "$OUT"

pid=""
stop() { [ -z "$pid" ] || { kill -TERM "$pid" 2>/dev/null && wait "$pid" || true; }; }
trap stop EXIT
if [ -z "${TARGET:-}" ]; then
    log=$OUT/moed.log
    "$BUILD_DIR/server/moed" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --synthetic "$SPEC" \
        2>"$log" &
    pid=$!
    # the ports it picked, from its log (port 0)
    for _ in $(seq 600); do
        grep -q 'msg="ready"' "$log" && break
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.1
    done
    TARGET=$(grep -o 'msg="ready" addr=[^ ]*' "$log" | cut -d= -f3)
    METRICS=$(grep -o 'msg="metrics listening" addr=[^ ]*' "$log" | cut -d= -f3)
    [ -n "$TARGET" ] || { echo "sweep_report: moed did not get ready; its log: $log" >&2; exit 1; }
fi

runs=()
for t in $TOKENS; do
    for tr in $TRANSPORTS; do
        f=$OUT/t$t-$tr.json
        echo "sweep_report: T=$t transport=$tr, concurrency $CONCURRENCY" >&2
        "$LOAD" --target "$TARGET" ${METRICS:+--metrics "$METRICS"} --concurrency "$CONCURRENCY" \
            --duration "$DURATION" --warmup 0.5 --tokens "$t" --transport "$tr" --json "$f" >/dev/null
        runs+=("$f")
    done
done
page=$OUT/sweep.html
"$LOAD" --report "$page" --from "$(IFS=,; echo "${runs[*]}")"
if command -v chromium >/dev/null; then
    HOME=${HOME:-/tmp} chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
        --window-size=1280,2600 --screenshot="$OUT/sweep.png" "file://$(realpath "$page")" \
        >/dev/null 2>&1
    echo "sweep_report: $page and its screenshot $OUT/sweep.png"
else
    echo "sweep_report: $page (no chromium here for a screenshot)"
fi
