#!/usr/bin/env bash
# Runs on the GPU machine, over a copy of the tree with .gpu/ carried (tests/gpu/bundle.sh builds it):
# the stages named as arguments, in order, each logging to $OUT.
#   tests     the CUDA-vs-CPU suite (tests/gpu/test_cuda_backend), every case
#   sanitize  compute-sanitizer memcheck and racecheck on the quick cases
#   bench     the kernel benchmark (moe-bench) and the torch._grouped_mm reference, same run, and the
#             merged table (kernels/cuda/bench/report.py)
#   e2e       the daemon benchmark on loopback (tests/gpu/bench_daemon.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/.gpu/py
export PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/moed-out}
mkdir -p "$OUT"
B=.gpu/bin
stage() { echo "== $1 ($(date +%T))"; }

stage device
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"

stages=("$@")
[ $# -gt 0 ] || stages=(tests bench)
for what in "${stages[@]}"; do
    case $what in
    tests)
        stage tests
        $B/test_cuda_backend 2>&1 | tee "$OUT/gpu-tests.log"
        echo "test_cuda_backend exit ${PIPESTATUS[0]}"
        ;;
    sanitize)
        stage sanitize
        for tool in memcheck racecheck; do
            MOED_GPU_TEST_QUICK=1 timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 \
                $B/test_cuda_backend >"$OUT/sanitize-$tool.log" 2>&1
            echo "compute-sanitizer $tool exit $?"
            tail -4 "$OUT/sanitize-$tool.log"
        done
        ;;
    bench)
        stage bench
        $B/moe-bench --tokens 8,64,512,4096,16384 --json "$OUT/moe.json" | tee "$OUT/moe.txt"
        $B/moe-bench --tokens 64,4096 --routing zipf,hot,empty --json "$OUT/moe-skew.json" | tee -a "$OUT/moe.txt"
        $B/moe-bench --tokens 4096,16384 --kernel sm80 --json "$OUT/moe-sm80.json" | tee -a "$OUT/moe.txt"
        python3 kernels/cuda/bench/torch_ref.py --tokens 8,64,512,4096,16384 --json "$OUT/torch.json"
        python3 kernels/cuda/bench/torch_ref.py --tokens 64,4096 --routing zipf,hot,empty --json "$OUT/torch-skew.json"
        python3 kernels/cuda/bench/report.py "$OUT/moe.json" "$OUT/torch.json" --out "$OUT/report.md"
        python3 kernels/cuda/bench/report.py "$OUT/moe-skew.json" "$OUT/torch-skew.json" --out "$OUT/report-skew.md"
        ;;
    e2e)
        stage e2e
        python3 tests/gpu/bench_daemon.py --json "$OUT/daemon.json" 2>&1 | tee "$OUT/daemon.txt"
        ;;
    *) echo "unknown stage $what" ;;
    esac
done
stage done
