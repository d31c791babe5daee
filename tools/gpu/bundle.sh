#!/usr/bin/env bash
# Builds moed with CUDA here and assembles .gpu/ for the GPU machine, which has the CUDA driver and
# toolkit but none of our C libraries and no package registry: the binaries, the shared libraries
# they need that it lacks, and the Python client. The device tool carries .gpu/ (git-ignored) with
# the working tree, 64 MiB in all: the daemon, the benchmarks and the GPU tests each hold the
# kernels' fatbin (about 19 MB; moectl and moed-load hold none), so the bundle is one gzipped
# archive, .gpu/bundle.tgz (about 55 MB, with the tree's 8.5 MB near the limit: a call that needs
# a few of the binaries carries an archive of those), which tools/gpu/run-on-gpu.sh unpacks there
# before it runs.
#
#   tools/gpu/bundle.sh               the bundle of this tree
#   tools/gpu/bundle.sh --base REV    after it: REV's moe-bench as .gpu/base.tgz, for the ab stage
#
# BUNDLE_BINS (names of .gpu/bin's programs, space-separated) keeps only those: a call whose
# stages need few of them carries less (tests, sanitize and ab: "moe-bench test_cuda_backend
# test_link_kernels", about 20 MB, which leaves room for the base bundle).
set -euo pipefail
cd "$(dirname "$0")/../.."

# Copies the shared libraries that the given files need into DEST, leaving out what every Linux
# machine with a GPU driver and the CUDA toolkit has: glibc's libraries, libstdc++, libgcc_s, the
# driver (libcuda, libnvidia-*) and the toolkit's libraries (libcudart, libcublas, ...).
bundle_libs() {
    local dest=$1 f name path
    local skip='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libnvidia-|libcudart|libcublas|libcublasLt|libcusparse|libcurand|libnvrtc|libnvJitLink)\.'
    shift
    for f in "$@"; do
        while read -r name path; do
            [[ $name =~ $skip ]] || [ -e "$dest/$name" ] || cp -L "$path" "$dest/$name"
        done < <(ldd "$f" | awk '/=> \//{print $1, $3}')
    done
    echo "bundle: $(ls "$dest" | wc -l) libraries in $dest ($(du -sh "$dest" | cut -f1))"
}

# --base REV: the build a change is timed against (run-on-gpu.sh's ab stage): REV checked out in
# build-gpu-base/src, built beside it, and its moe-bench with the libraries it needs packed as
# .gpu/base.tgz (about 7 MB: it needs none the GPU machine lacks), next to the bundle made before
# (this leaves that one alone).
if [ "${1:-}" = --base ]; then
    rev=${2:?usage: tools/gpu/bundle.sh --base REV}
    src=build-gpu-base/src
    git worktree remove --force "$src" 2>/dev/null || rm -rf "$src"
    git worktree prune
    git worktree add -q --detach "$src" "$rev"
    cmake -S "$src" -B build-gpu-base/build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build-gpu-base/build -j2 --target moe-bench
    pack=$(mktemp -d)
    trap 'rm -rf "$pack"' EXIT
    mkdir -p "$pack/bin" "$pack/lib" .gpu
    cp build-gpu-base/build/bench/moe-bench "$pack/bin/"
    bundle_libs "$pack/lib" "$pack/bin/moe-bench"
    tar czf .gpu/base.tgz -C "$pack" bin lib
    git worktree remove --force "$src"
    du -sh .gpu/base.tgz
    exit 0
fi

cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOED_BUILD_TESTS=ON >/dev/null
cmake --build build-gpu -j2
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib .gpu/py
cp build-gpu/server/moed build-gpu/client/c/moectl build-gpu/bench/moe-bench \
   build-gpu/bench/moe-split-bench build-gpu/tests/gpu/test_cuda_backend build-gpu/tests/gpu/test_cuda_parts \
   build-gpu/tests/gpu/test_ipc build-gpu/tests/gpu/test_split build-gpu/tests/gpu/test_dev_route \
   build-gpu/tests/gpu/test_route_pack build-gpu/tests/gpu/test_ring_stream build-gpu/bench/doorbell-graph \
   build-gpu/bench/link-bench build-gpu/tests/gpu/test_link_kernels \
   .gpu/bin/
[ -x build-gpu/client/c/moed-load ] && cp build-gpu/client/c/moed-load .gpu/bin/
if [ -n "${BUNDLE_BINS:-}" ]; then
    for f in .gpu/bin/*; do
        [[ " $BUNDLE_BINS " == *" ${f##*/} "* ]] || rm "$f"
    done
    for f in $BUNDLE_BINS; do
        [ -x ".gpu/bin/$f" ] || { echo "bundle: BUNDLE_BINS names $f, which the build has not" >&2; exit 1; }
    done
fi
# The Python client with libmoedclient inside (the doorbell's, moed.RingClient): this build's copy,
# its gRPC C core and the rest into .gpu/lib beside the binaries' (run-on-gpu.sh puts it on
# LD_LIBRARY_PATH).
MOED_CLIENT_LIB=$PWD/build-gpu/client/c/libmoedclient.so \
    .venv/bin/pip install -q --no-deps --no-build-isolation --target .gpu/py ./client/python
bundle_libs .gpu/lib .gpu/bin/* .gpu/py/moed/_lib/libmoedclient.so
tar czf .gpu/bundle.tgz -C .gpu bin lib py
rm -rf .gpu/bin .gpu/lib .gpu/py
du -sh .gpu/bundle.tgz
