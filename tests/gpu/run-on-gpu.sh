#!/usr/bin/env bash
# Runs on the GPU machine, over a copy of the tree with .gpu/ carried (tests/gpu/bundle.sh builds it):
# the stages named as arguments, in order, each logging to $OUT.
#   tests     the CUDA-vs-CPU suite (tests/gpu/test_cuda_backend), every case
#   sanitize  compute-sanitizer memcheck and racecheck on the quick cases
#   bench     the kernel benchmark (moe-bench) and the torch._grouped_mm reference, same run, and the
#             merged table (kernels/cuda/bench/report.py)
#   e2e       the daemon benchmark on loopback (tests/gpu/bench_daemon.py), transport suite
#   merge     the same, merging suite (merging off / on / batch gating at T=8)
#   pytest    end-to-end tests through a CUDA daemon: merged requests bit-identical to the same
#             requests alone, batch gating across merged callers against numpy
#   fp8       FP8 weights (issue 13): the suite's FP8 cases (every shape class on the FP8 Tensor
#             Cores and on the portable path, against the CPU; FP8 against bf16 on one model),
#             compute-sanitizer memcheck and racecheck on the quick FP8 cases, and moe-bench with
#             bf16 and FP8 weights side by side (standard shapes, T = 8 .. 16384, graph-replayed
#             small batches, two padded --shape ones) with both matmul ceilings
#   dataplane tensor regions (issue 11): the backend's parts against inline (test_cuda_parts), CUDA
#             IPC from a second process against inline (test_ipc), then the data-plane benchmark
#             (tests/gpu/bench_dataplane.py: T 8..8192 x callers 1, 8 x inline/shm/cuda on the
#             mixtral and qwen3-30b-a3b shapes, kernel-only and the RPC floor in the same run),
#             its table in dataplane.md
#   router    the server router (issue 8): the CUDA-vs-CPU router cases of the suite, the
#             checkpoints written by transformers served by a CUDA daemon against transformers'
#             own outputs (recomputed live by the torch and transformers installed there), and the
#             table of relative errors per checkpoint and routing (hf-table.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/.gpu/py
export PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/moed-out}
RAW=$OUT/raw # JSON and long logs; packed into raw.tgz at the end (the device tool returns 8 files)
mkdir -p "$RAW"
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
                $B/test_cuda_backend >"$RAW/sanitize-$tool.log" 2>&1
            echo "compute-sanitizer $tool exit $?"
            tail -4 "$RAW/sanitize-$tool.log"
        done
        ;;
    bench)
        stage bench
        $B/moe-bench --tokens 8,64,512,4096,16384 --json "$RAW/moe.json" | tee "$OUT/moe.txt"
        $B/moe-bench --tokens 8,64 --graph --json "$RAW/moe-graph.json" | tee -a "$OUT/moe.txt"
        $B/moe-bench --tokens 64,4096 --routing zipf,hot,empty --json "$RAW/moe-skew.json" | tee -a "$OUT/moe.txt"
        $B/moe-bench --tokens 4096,16384 --kernel sm80,sm90,sm90p --cublas --json "$RAW/moe-kernels.json" | tee -a "$OUT/moe.txt"
        python3 kernels/cuda/bench/torch_ref.py --tokens 8,64,512,4096,16384 --json "$RAW/torch.json"
        python3 kernels/cuda/bench/torch_ref.py --tokens 64,4096 --routing zipf,hot,empty --json "$RAW/torch-skew.json"
        python3 kernels/cuda/bench/report.py "$RAW/torch.json" "$RAW/moe.json" "$RAW/moe-graph.json" \
            --out "$OUT/report.md"
        python3 kernels/cuda/bench/report.py "$RAW/torch-skew.json" "$RAW/moe-skew.json" --out "$OUT/report-skew.md"
        ;;
    e2e)
        stage e2e
        python3 tests/gpu/bench_daemon.py --bin $B --suite transport --json "$RAW/daemon.json" --logs "$RAW" \
            2>&1 | tee -a "$OUT/daemon.txt"
        ;;
    merge)
        stage merge
        python3 tests/gpu/bench_daemon.py --bin $B --suite merging --json "$RAW/merge.json" --logs "$RAW" \
            2>&1 | tee -a "$OUT/daemon.txt"
        ;;
    pytest)
        stage pytest
        MOED_BIN=$PWD/$B/moed MOED_TEST_COMPUTE=bf16 python3 -m pytest -q -p no:cacheprovider \
            tests/e2e/test_concurrency.py 2>&1 | tee "$OUT/pytest-gpu.log"
        ;;
    fp8)
        stage fp8
        MOED_GPU_TEST_FP8_ONLY=1 timeout 420 $B/test_cuda_backend 2>&1 | tee "$OUT/gpu-fp8.log"
        echo "test_cuda_backend (fp8) exit ${PIPESTATUS[0]}"
        for tool in memcheck racecheck; do
            MOED_GPU_TEST_FP8_ONLY=1 MOED_GPU_TEST_QUICK=1 timeout 240 compute-sanitizer \
                --tool $tool --error-exitcode 9 $B/test_cuda_backend >"$RAW/sanitize-fp8-$tool.log" 2>&1
            echo "compute-sanitizer fp8 $tool exit $?"
            tail -4 "$RAW/sanitize-fp8-$tool.log"
        done
        ;;
    fp8-bench)
        stage fp8-bench
        timeout 300 $B/moe-bench --weights bf16,fp8 --tokens 8,64,512,4096,16384 --min-ms 100 \
            --json "$RAW/moe-fp8.json" | tee "$OUT/moe-fp8.txt"
        timeout 120 $B/moe-bench --weights bf16,fp8 --tokens 8,64 --graph --min-ms 100 \
            --json "$RAW/moe-fp8-graph.json" | tee -a "$OUT/moe-fp8.txt"
        timeout 120 $B/moe-bench --shape 4000,1400,64,6 --shape 2880,2880,128,4 --weights bf16,fp8 \
            --tokens 64,4096 --min-ms 100 --json "$RAW/moe-fp8-shapes.json" | tee -a "$OUT/moe-fp8.txt"
        python3 kernels/cuda/bench/report.py --fp8 "$RAW/moe-fp8.json" "$RAW/moe-fp8-graph.json" \
            "$RAW/moe-fp8-shapes.json" --out "$OUT/report-fp8.md"
        ;;
    dataplane)
        stage dataplane
        df -h /dev/shm | tail -1
        $B/test_cuda_parts 2>&1 | tee "$OUT/gpu-parts.log"
        echo "test_cuda_parts exit ${PIPESTATUS[0]}"
        $B/test_ipc $B/moed 2>&1 | tee -a "$OUT/gpu-parts.log"
        echo "test_ipc exit ${PIPESTATUS[0]}"
        python3 tests/gpu/bench_dataplane.py --bin $B --md "$OUT/dataplane.md" \
            --json "$RAW/dataplane.json" --logs "$RAW" ${DATAPLANE_ARGS:-} 2>&1 | tee "$OUT/dataplane.txt"
        ;;
    router)
        stage router
        MOED_GPU_TEST_ROUTER_ONLY=1 $B/test_cuda_backend 2>&1 | tee "$OUT/gpu-router.log"
        echo "test_cuda_backend (router) exit ${PIPESTATUS[0]}"
        MOED_BIN=$PWD/$B/moed MOED_TEST_COMPUTE=bf16 python3 -m pytest -q -p no:cacheprovider \
            tests/e2e/test_hf_models.py 2>&1 | tee "$OUT/pytest-hf.log"
        python3 tests/e2e/hf_models/table.py --moed $B/moed --backend cuda --logs "$RAW" \
            2>&1 | tee "$OUT/hf-table.md"
        ;;
    *) echo "unknown stage $what" ;;
    esac
done
tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$RAW"
stage done
