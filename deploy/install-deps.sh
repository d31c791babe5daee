#!/usr/bin/env bash
# Installs what building, running and testing moed needs on Debian 12 (or Ubuntu 24.04): the C
# toolchain and libraries from the distribution, and a Python virtual environment (.venv) with the
# clients' and tests' packages. Installs only what is missing, so it is cheap to run every time.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake pkg-config libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
      libuv1-dev libcjson-dev libsystemd-dev python3-venv)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "install-deps: installing ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The venv is rebuilt when the pinned requirements change.
req=tests/requirements.txt
stamp=.venv/.requirements
if [ ! -x .venv/bin/python ] || ! cmp -s "$req" "$stamp"; then
    echo "install-deps: creating .venv from $req"
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -r "$req"
    cp "$req" "$stamp"
fi
