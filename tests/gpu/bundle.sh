#!/usr/bin/env bash
# Builds moed with CUDA here and assembles .gpu/ for the GPU machine, which has the CUDA driver and
# toolkit but none of our C libraries and no package registry: the binaries, the shared libraries
# they need that it lacks (../shared/tools/bundle-libs), and the Python client. The device tool
# carries .gpu/ (git-ignored); tests/gpu/run-on-gpu.sh runs there.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOED_BUILD_TESTS=ON >/dev/null
cmake --build build-gpu -j2
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib .gpu/py
cp build-gpu/server/moed build-gpu/client/c/moectl build-gpu/kernels/cuda/moe-bench \
   build-gpu/tests/gpu/test_cuda_backend .gpu/bin/
[ -x build-gpu/client/c/moed-load ] && cp build-gpu/client/c/moed-load .gpu/bin/
../shared/tools/bundle-libs .gpu/lib .gpu/bin/*
.venv/bin/pip install -q --no-deps --no-build-isolation --target .gpu/py ./client/python
du -sh .gpu
