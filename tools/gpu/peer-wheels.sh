#!/usr/bin/env bash
# Packs the peer the benchmark measures moed against beside torch._grouped_mm — SonicMoE
# (bench/kernels/sonic_ref.py) — for the GPU machine, which has torch, triton, einops, numpy
# and cuda-bindings but no SonicMoE and no internet. Run here (where PyPI answers), in the top of the
# tree: downloads the wheels SonicMoE needs beyond what the GPU machine has, for its Python 3.12 on
# x86-64, unpacks them into one site folder, drops what a forward pass never loads, and packs it as
# .whl/peers.tar.xz. On the GPU machine run-on-gpu.sh's sonic and peers stages unpack it
# (MOED_PEERS_SITE, default /tmp/moed-peers) and put it on PYTHONPATH.
#
# Size: the CuTe DSL compiler (nvidia-cutlass-dsl-libs-base, one 144 MB shared library) packs to
# about 50 MB, more than the device tool's 64 MiB a call leaves beside .gpu/bundle.tgz: carry .whl
# in a call of its own (run-on-gpu.sh sonic), then .gpu in the next (docs/benchmarks.md, "How the
# kernels are compared with their peers").
#
# The versions are pinned together: sonic-moe 0.1.2.post1 pins nvidia-cutlass-dsl 4.4.2;
# quack-kernels 0.3.11 (released with it, the oldest it accepts) has every QuACK name it imports.
# sonic-moe asks for torch <= 2.9.1; the GPU machine's 2.11 is used as it is (nothing installs).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=.whl                                               # what a device call carries: peers.tar.xz
CACHE=${PEER_WHEELS_CACHE:-$HOME/.cache/moed-peer-wheels} # the wheels (over 64 MiB): never carried
PINS=(
    sonic-moe==0.1.2.post1
    quack-kernels==0.3.11
    nvidia-cutlass-dsl==4.4.2
    nvidia-cutlass-dsl-libs-base==4.4.2
    apache-tvm-ffi==0.1.15.post2
    torch-c-dlpack-ext==0.1.5
)
mkdir -p "$W" "$CACHE"
echo '*' >"$W/.gitignore" # the folder travels only when a device call carries it
for p in "${PINS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$CACHE" "$p"
done
# Each wheel's requirements, to check against the GPU machine's packages when a pin moves.
wheels=()
for p in "${PINS[@]}"; do
    n=${p%%==*}
    wheels+=("$(ls "$CACHE"/"${n//-/_}"-"${p#*==}"-*.whl)")
done
for f in "${wheels[@]}"; do
    echo "${f##*/}: $(unzip -p "$f" '*/METADATA' | grep '^Requires-Dist' | grep -v extra |
        cut -d' ' -f2- | paste -sd, -)"
done

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
for f in "${wheels[@]}"; do unzip -qo "$f" -d "$site"; done
# Never loaded by a forward pass: the DSL's C header and static runtime (ahead-of-time export only).
rm -rf "$site/nvidia_cutlass_dsl/include" "$site/nvidia_cutlass_dsl/lib/libcuda_dialect_runtime_static.a"
# The DSL's package sits under python_packages/ behind a .pth file, which PYTHONPATH does not read:
# run-on-gpu.sh puts that folder on PYTHONPATH too.
test -d "$site/nvidia_cutlass_dsl/python_packages/cutlass"
tar cf - -C "$site" . | xz --x86 --lzma2=preset=9e --threads=1 >"$W/peers.tar.xz"
du -b "${wheels[@]}" "$W/peers.tar.xz" | awk '{printf "%6.1f MB  %s\n", $1 / 1e6, $2}'
