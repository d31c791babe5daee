#!/usr/bin/env bash
# Checks deploy/ as far as a machine without a container engine or a cluster allows:
# systemd-analyze verify on the unit, the Kubernetes manifests parsed and checked field by field,
# the container file against the lint rules we care about, the shipped config file started
# with the real daemon (tests/deploy/test_deploy.py says what each check asserts), and the Grafana
# dashboard and Prometheus alert rules against a live daemon's /metrics and promtool
# (tests/deploy/test_dashboards.py). Where a Docker
# engine with BuildKit runs, `docker build --check` lints the container file too.
#
#   tests/deploy-check.sh          (BUILD_DIR, default build, must hold server/moed)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
PY=.venv/bin/python

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
if ! command -v systemd-analyze >/dev/null; then
    echo "deploy-check: installing systemd (for systemd-analyze)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends systemd
fi
"$PY" -c "import yaml" 2>/dev/null || "$PY" -m pip install -q PyYAML==6.0.3

# promtool, from Debian's prometheus package, unpacked into the build folder (not installed: the
# package would also set up a Prometheus server).
PROMTOOL=$(command -v promtool || echo "$BUILD_DIR/promtool/usr/bin/promtool")
if [ ! -x "$PROMTOOL" ]; then
    echo "deploy-check: fetching promtool (Debian's prometheus package)"
    dl=$(mktemp -d)
    (cd "$dl" && { apt-get download prometheus 2>/dev/null ||
        { $sudo apt-get update -qq && apt-get download prometheus; }; })
    dpkg-deb -x "$dl"/prometheus_*.deb "$BUILD_DIR/promtool"
    rm -rf "$dl"
fi
PROMTOOL=$(realpath "$PROMTOOL") # the tests run it from other folders too
export PROMTOOL

MOED_BUILD_DIR="$PWD/$BUILD_DIR" "$PY" -m pytest -q -rs -p no:cacheprovider tests/deploy

if command -v docker >/dev/null && docker info >/dev/null 2>&1 &&
    docker build --help 2>/dev/null | grep -q -- '--check'; then
    docker build --check -f deploy/Containerfile .
else
    echo "deploy-check: docker build --check skipped (no running Docker engine with BuildKit)"
fi
