#!/usr/bin/env bash
# Runs on the GPU machine, over a copy of the tree with .gpu/ carried (tools/gpu/bundle.sh builds it):
# the stages named as arguments, in order, each logging to $OUT.
#   tests     the CUDA-vs-CPU suite (tests/gpu/test_cuda_backend), every case, then the quick cases
#             under each gather policy of the bf16 Hopper kernel (MOED_CUDA_GATHER_POLICY), and the
#             links' kernels against the host (tests/gpu/test_link_kernels)
#   sanitize  compute-sanitizer memcheck and racecheck on the quick cases
#   bench     the kernel benchmark (moe-bench) and the torch._grouped_mm reference, same run, and the
#             merged table (bench/kernels/report.py)
#   sonic     SonicMoE (the fastest published MoE forward on Hopper) alone, for a call that carries
#             .whl (tools/gpu/peer-wheels.sh) and not .gpu, the two being over the device tool's size
#             limit together: bench/kernels/sonic_ref.py on the standard shapes and MODEL_SHAPES
#             at T = 8 .. 16384, its JSON in sonic.json (for peers' SONIC_JSON); it leaves the unpacked
#             site and QuACK's compiled kernels and tunings on the machine for a peers call that follows
#   peers     moed beside torch._grouped_mm and SonicMoE: moe-bench on the standard shapes
#             and the real models' layers (MODEL_SHAPES) at T = 8 .. 16384 (graph-replayed at T <= 64),
#             torch_ref.py and sonic_ref.py on the same, and report.py's table and targets in peers.md
#             (one short line a row on stdout). SonicMoE's rows come from sonic_ref.py here where its
#             site is (carried as .whl/peers.tar.xz or left by a sonic call on this machine), else
#             from SONIC_JSON where that names a file (an earlier sonic call's), else they say why not.
#             (On an H200: the sonic stage 5 minutes, QuACK compiling and tuning; peers with
#             SONIC_JSON about a minute.)
#   e2e       the daemon benchmark on loopback (bench/daemon/bench_daemon.py), transport suite
#   merge     the same, merging suite (merging off / on / batch gating at T=8)
#   pytest    end-to-end tests through a CUDA daemon: every dtype, activation and gating against
#             numpy token by token, merged requests bit-identical to the same requests alone,
#             batch gating across merged callers; MOED_TEST_COMPUTE makes every daemon prove it
#             serves on the cuda backend (tests/e2e/conftest.py)
#   fp8       FP8 weights: the suite's FP8 cases (every shape class on the FP8 Tensor
#             Cores and on the portable path, against the CPU; FP8 against bf16 on one model),
#             compute-sanitizer memcheck and racecheck on the quick FP8 cases
#   ab        a change timed against the build before it: moe-bench of the base build (.gpu/base.tgz,
#             from tools/gpu/bundle.sh --base REV) and of this one, in turn, AB_REPS times (default
#             3), on AB_ARGS (default the standard shapes and MODEL_SHAPES at T = 512, 4096, 16384),
#             and report.py --ab's table of medians, ratios and spreads in ab.md (one line a row on
#             stdout): about 4 minutes on an H200 with the defaults
#   fp8-bench moe-bench with bf16 and FP8 weights side by side (standard shapes, T = 8 .. 16384,
#             graph-replayed small batches, two padded --shape ones) with both matmul ceilings
#   sparse    2:4 sparse experts on the Sparse Tensor Cores: the suite's sparse cases
#             (MOED_GPU_TEST_SPARSE_ONLY; again with wgmma.sp for every batch, gathered and
#             pre-permuted), compute-sanitizer memcheck on the quick ones (table and wgmma.sp), then
#             moe-bench --weights bf16,sparse24 on the standard shapes and SPARSE_SHAPES at
#             T = 8 .. 16384 (graph-replayed at T <= 64 too), torch's semi-structured sparse matmul
#             on the same (bench/kernels/torch_sparse_ref.py), and the table in sparse.md; first
#             the e2e 2:4 tests through a CUDA daemon (tests/e2e/test_sparse24.py: the
#             compressed-tensors checkpoints and --weights sparse24 against the float64 oracle)
#   dataplane tensor regions: the backend's parts against inline (test_cuda_parts), CUDA
#             IPC from a second process against inline (test_ipc), then the data-plane benchmark
#             (bench/daemon/bench_dataplane.py: T 8..8192 x callers 1, 8 x inline/shm/cuda on the
#             mixtral and qwen3-30b-a3b shapes, kernel-only and the RPC floor in the same run),
#             its table in dataplane.md; 48 loads of 1 s warm-up + 1.5 s measured, 8 daemons'
#             starts and 8 moe-bench runs: about 4 minutes on an H200
#   python    the Python client with torch: torch CPU and CUDA tensors in every dtype
#             through every transport against the numpy inline path, CUDA calls through a CUDA region
#             with no tensor byte in the messages (tests/gpu/test_python_torch.py), then the
#             data-plane benchmark with the Python client's rows beside moed-load's, same daemon,
#             same run (bench_dataplane.py --python: a Python load of 0.5 s warm-up + 1.5 s after
#             each moed-load), its tables in python.md: about 7 minutes on an H200
#   router    the server router: the CUDA-vs-CPU router cases of the suite, the
#             checkpoints written by transformers served by a CUDA daemon against transformers'
#             own outputs (recomputed live by the torch and transformers installed there), and the
#             table of relative errors per checkpoint and routing (hf-table.md)
#   generate  transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 generating 32 tokens with a CUDA moed
#             serving their MoE blocks: the recorded generations replayed (test_hf_generate, the
#             live tests with the model on the CPU), then tests/e2e/hf_generate/run_gpu.py with the
#             model on cuda: transformers' own tokens against the Python client's and the torch
#             op's, its decode step captured in one CUDA graph too, into generate.md
#   droute    routing kept in GPU memory, read and checked on the device (tests/gpu/test_dev_route:
#             every case bit-identical to the same launch routed on the host, statuses and messages
#             as the host check words them; the packed route's host side, test_route_pack), then
#             compute-sanitizer memcheck and racecheck on its quick cases (not yet timed)
#   split     expert parallelism on one GPU: tests/gpu/test_split with two placements
#             on GPU 0 (--devices 0,0), every case within one output rounding of the layer
#             unsplit per token, against the CPU backend and float64, and deterministic, and
#             compute-sanitizer memcheck on its quick cases
#   two-gpu   expert parallelism on two GPUs (skipped, exit 77, with fewer): test_split
#             over GPUs 0,1 with peer access, and its quick cases again through landing buffers
#             (MOED_CUDA_NO_PEER=1);
#             moe-bench's DeepSeek-V3 layer on one GPU; moe-split-bench (the layer whole on GPU 0
#             and split over 0,1 at T = 8 and 4096, and the peer bandwidth); and the daemons
#             (bench_daemon.py --suite multi: the layer split, two layers one per GPU, each beside
#             the same on GPU 0, replies compared byte for byte, moed-load at T = 8 and 4096). The
#             tables go to two-gpu.md.
#   four-gpu  expert parallelism on four GPUs (skipped, exit 77, with fewer): test_split over
#             GPUs 0..3 (quick cases); moe-split-bench on DeepSeek-V3's layer and gpt-oss-120b's
#             (128 experts), whole on GPU 0 and split over 0,1 and over 0..3, uniform and zipf
#             routing (zipf also placed by its measured load), T = 8 .. 16384; the daemons
#             (bench_daemon.py --suite multi --gpus 4, moed-load inline and through CUDA regions);
#             and a whole model on the host (bench/daemon/bench_model.py: DeepSeek-V3's shape in
#             FP8, MODEL_LAYERS (default 40) layers over the four GPUs, load time and memory per GPU,
#             a decode step through every layer from one caller at T = 8, 64, 512). Tables in
#             four-gpu.md: about 9 minutes on 4 x H200.
#   links     fleets over NCCL links (skipped, exit 77, with fewer than 2 GPUs): the GPU tests
#             (tests/e2e/test_links_gpu.py: links against gRPC and one daemon, every dtype, a close
#             while another link idles, the socket transport, a shard killed under load, the Python
#             client with torch), then
#             bench/daemon/bench_links.py (DeepSeek-V3's layer over 2 and 3 GPUs from a caller on
#             GPU 0, beside gRPC and one daemon, NVLink and sockets; at T = 4096 two callers at
#             once too) into links.json. NCCL is torch's
#             (MOED_NCCL_LIB, found from the nvidia-nccl wheel torch depends on).
#   other-gpu CUDA regions on a GPU moed does not compute on (skipped, exit 77, with fewer than two
#             GPUs): test_cuda_parts (the backend on GPU 0, parts and expert choices on GPU 1, the
#             copies staged through host memory, then with peer access), test_ipc two-gpu (moed
#             --devices 1, the caller's memory on GPU 0: with peer access, then MOED_CUDA_NO_PEER=1;
#             moed seeing GPU 1 alone refuses it by name), compute-sanitizer memcheck on
#             test_cuda_parts. tools/gpu/two_gpu.sh runs split, two-gpu and other-gpu.
#   doorbell  the doorbell, under MPS (started here with nvidia-cuda-mps-control -d where it can be,
#             stopped after; doorbell.md says whether it was on): test_ring_stream (stream-ordered
#             calls and a CUDA graph of them against the same calls from the host, bit for bit, the
#             caller on GPU 0 and on GPU 1 where there is one), then the benchmark grid
#             (bench/daemon/doorbell_grid.py: four layers x T 1..2048 x 1 and 8 callers x the
#             caller's GPU x start/wait, stream, a 60-call graph, gRPC beside moe-bench, the floor,
#             the idle CPU), its table and targets in doorbell.md: about 8 minutes on an H200
#   torch-op  the Python caller on the doorbell, under MPS as doorbell: tests/gpu/test_ring_torch.py
#             (torch CUDA tensors through moed.RingClient and torch.ops.moed.forward on a side
#             stream, a CUDA graph of several layers, the allocator's segments registered), then
#             bench/daemon/bench_torch_op.py (the op eager and in a graph beside the C doorbell path
#             and the kernel at T 1..2048, a 60-call decode step in one graph, 8 threads and 8
#             processes beside moed-load), its table and targets in torch-op.md: at most 7.5 minutes
#
# Every command of a stage counts: a stage passed when all of them exited 0, was skipped when one
# reported exit 77 (no GPU answered) and none failed, and failed otherwise (a missing program too).
# The device check comes first and counts like a stage. At the end a summary names each stage with
# its result, and the exit status says the worst: 0 all passed, 1 some failed, 77 none failed but
# some were skipped; 2 for an unknown stage, before anything runs.
#
# Environment: OUT (default /tmp/moed-out), MOED_GPU_DIR (default .gpu: bin/, lib/ and py/ as
# bundle.sh assembles them, or its bundle.tgz of them), MOED_GPU_PYTHON (default python3),
# DATAPLANE_ARGS (more arguments for bench_dataplane.py, e.g. --shapes mixtral; the python stage's
# run too), MOED_PEERS_SITE (default /tmp/moed-peers: where .whl/peers.tar.xz is unpacked),
# SONIC_JSON (peers: SonicMoE's rows from this file where it cannot run here), PEER_TOKENS (the
# sonic and peers stages' batch sizes, default 8,64,512,4096,16384).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
GPU=${MOED_GPU_DIR:-$PWD/.gpu}
# bundle.sh packs the bundle to travel under the device tool's size limit: unpacked afresh here.
if [ -f "$GPU/bundle.tgz" ]; then
    rm -rf "${GPU:?}/bin" "${GPU:?}/lib" "${GPU:?}/py"
    tar xzf "$GPU/bundle.tgz" -C "$GPU" || exit 2
fi
B=$GPU/bin
PY=${MOED_GPU_PYTHON:-python3}
export LD_LIBRARY_PATH=$GPU/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$GPU/py
export PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/moed-out}
RAW=$OUT/raw # JSON and long logs; packed into raw.tgz at the end (the device tool returns 8 files)
STAGES=(tests sanitize bench ab sonic peers e2e merge pytest fp8 fp8-bench sparse dataplane python router generate
    droute split two-gpu four-gpu links other-gpu doorbell torch-op)
PEERS=${MOED_PEERS_SITE:-/tmp/moed-peers}
# Real models' MoE layers as d,ff,E,k (bench/kernels/torch_ref.py's MODELS, which a CI test keeps
# equal to this): gpt-oss-120b, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, Phi-3.5-MoE, DBRX, then four the
# kernels' table was never tuned on: Mixtral-8x22B, Qwen2-57B-A14B, Qwen3-235B-A22B, Llama-4-Scout.
# shellcheck disable=SC2054  # each element is one d,ff,E,k
MODEL_SHAPES=(2880,2880,128,4 2048,1408,60,4 2048,1024,64,8 4096,6400,16,2 6144,10752,16,4
    6144,16384,8,2 3584,2560,64,8 4096,1536,128,8 5120,8192,16,1)
PEER_TOKENS=${PEER_TOKENS:-8,64,512,4096,16384}
# The sparse stage's real layers beside the standard shapes: Qwen1.5-MoE-A2.7B (E not a power of
# two), gpt-oss-120b (d and ff 2880, padded) and OLMoE-1B-7B (which the sparse kernels were never
# tuned on).
# shellcheck disable=SC2054  # each element is one d,ff,E,k
SPARSE_SHAPES=(2048,1408,60,4 2880,2880,128,4 2048,1024,64,8)

# The stage running and the worst exit of its commands so far (0, 77, or a failure's code).
stage_name="" stage_rc=0
results=()

# The helpers run one command of the current stage and count its exit status: step as it is,
# logged with its output also in LOG (tee), quiet with its output in LOG alone.
step() {
    "$@"
    count $? "$1"
}

logged() {
    local log=$1
    shift
    "$@" 2>&1 | tee "$log"
    count "${PIPESTATUS[0]}" "$1"
}

quiet() {
    local log=$1
    shift
    "$@" >"$log" 2>&1
    count $? "$1"
}

count() {
    local rc=$1
    [ "$rc" -eq 0 ] && return
    echo "run-on-gpu: stage $stage_name: $2 exited $rc"
    if [ "$rc" -eq 77 ]; then
        [ "$stage_rc" -ne 0 ] || stage_rc=77
    elif [ "$stage_rc" -eq 0 ] || [ "$stage_rc" -eq 77 ]; then
        stage_rc=$rc
    fi
}

stage_device() {
    logged "$OUT/device.txt" nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
        --format=csv
}

stage_tests() {
    logged "$OUT/gpu-tests.log" "$B/test_cuda_backend"
    # the quick cases under each gather policy of the bf16 Hopper kernel, whatever the table picks
    local p
    for p in tile arrive; do
        MOED_CUDA_GATHER_POLICY=$p MOED_GPU_TEST_QUICK=1 quiet "$RAW/gpu-tests-gather-$p.log" \
            "$B/test_cuda_backend"
        tail -1 "$RAW/gpu-tests-gather-$p.log"
    done
    logged "$OUT/gpu-link-kernels.log" "$B/test_link_kernels"
}

stage_sanitize() {
    local tool
    for tool in memcheck racecheck; do
        MOED_GPU_TEST_QUICK=1 quiet "$RAW/sanitize-$tool.log" timeout 240 compute-sanitizer \
            --tool $tool --error-exitcode 9 "$B/test_cuda_backend"
        tail -4 "$RAW/sanitize-$tool.log"
    done
}

stage_bench() {
    logged "$OUT/moe.txt" "$B/moe-bench" --tokens 8,64,512,4096,16384 --json "$RAW/moe.json"
    logged "$RAW/moe-graph.txt" "$B/moe-bench" --tokens 8,64 --graph --json "$RAW/moe-graph.json"
    logged "$RAW/moe-skew.txt" "$B/moe-bench" --tokens 64,4096 --routing zipf,hot,empty \
        --json "$RAW/moe-skew.json"
    logged "$RAW/moe-kernels.txt" "$B/moe-bench" --tokens 4096,16384 --kernel sm80,sm90,sm90p --cublas \
        --json "$RAW/moe-kernels.json"
    cat "$RAW/moe-graph.txt" "$RAW/moe-skew.txt" "$RAW/moe-kernels.txt" >>"$OUT/moe.txt"
    step "$PY" bench/kernels/torch_ref.py --tokens 8,64,512,4096,16384 --json "$RAW/torch.json"
    step "$PY" bench/kernels/torch_ref.py --tokens 64,4096 --routing zipf,hot,empty \
        --json "$RAW/torch-skew.json"
    step "$PY" bench/kernels/report.py "$RAW/torch.json" "$RAW/moe.json" "$RAW/moe-graph.json" \
        --out "$OUT/report.md"
    step "$PY" bench/kernels/report.py "$RAW/torch-skew.json" "$RAW/moe-skew.json" \
        --out "$OUT/report-skew.md"
}

# Single runs of one build against another's read 3-5% noise on an H200 as effects
# (docs/kernels-notes.md): the two take turns, several times, and the table gives medians.
stage_ab() {
    local base=$GPU/base rep args=()
    if [ ! -f "$GPU/base.tgz" ]; then
        echo "run-on-gpu: ab: no $GPU/base.tgz: make it with tools/gpu/bundle.sh --base REV (after bundle.sh)"
        count 2 ab
        return
    fi
    rm -rf "$base"
    mkdir -p "$base"
    if ! tar xzf "$GPU/base.tgz" -C "$base"; then
        count 2 tar
        return
    fi
    if [ -n "${AB_ARGS:-}" ]; then
        read -ra args <<<"$AB_ARGS"
    else
        mapfile -t args < <(model_args)
        # shellcheck disable=SC2054  # one list of sizes
        args+=(--tokens 512,4096,16384 --min-ms 60)
    fi
    for rep in $(seq "${AB_REPS:-3}"); do
        LD_LIBRARY_PATH=$base/lib:$LD_LIBRARY_PATH quiet "$RAW/ab-base$rep.txt" timeout 300 \
            "$base/bin/moe-bench" "${args[@]}" --json "$RAW/ab-base$rep.json"
        quiet "$RAW/ab-new$rep.txt" timeout 300 "$B/moe-bench" "${args[@]}" --json "$RAW/ab-new$rep.json"
    done
    step "$PY" bench/kernels/report.py --ab "$RAW"/ab-base*.json --vs "$RAW"/ab-new*.json \
        --out "$OUT/ab.md" --brief
}

# The standard shapes and a --shape for each of MODEL_SHAPES, for moe-bench, torch_ref.py and
# sonic_ref.py alike.
model_args() {
    local s
    printf -- '--shapes\nmixtral,qwen3-30b-a3b,deepseek-v3\n' # moe-bench runs --shape alone without them
    for s in "${MODEL_SHAPES[@]}"; do printf -- '--shape\n%s\n' "$s"; done
}

# SONIC: the environment sonic_ref.py runs in, SonicMoE's site on PYTHONPATH (the DSL's package sits
# in a folder of its own that a .pth file names, which PYTHONPATH does not read), unpacked first from
# a carried .whl/peers.tar.xz; QuACK keeps its tunings on disk beside its compiled kernels, for a
# later call on this machine.
peers_site() {
    if [ -f .whl/peers.tar.xz ] && [ ! -f "$PEERS/.unpacked" ]; then
        mkdir -p "$PEERS" && tar xJf .whl/peers.tar.xz -C "$PEERS" && touch "$PEERS/.unpacked"
    fi
    [ -d "$PEERS/sonicmoe" ] || echo "run-on-gpu: no SonicMoE in $PEERS (carry .whl: tools/gpu/peer-wheels.sh)"
    SONIC=(env "PYTHONPATH=$PEERS:$PEERS/nvidia_cutlass_dsl/python_packages:$PYTHONPATH"
        QUACK_CACHE_AUTOTUNING=1 "$PY" bench/kernels/sonic_ref.py)
}

stage_sonic() {
    local shapes
    mapfile -t shapes < <(model_args)
    peers_site
    step timeout 480 "${SONIC[@]}" "${shapes[@]}" --tokens "$PEER_TOKENS" --min-ms 100 --json "$OUT/sonic.json"
}

stage_peers() {
    local shapes sonic=$RAW/sonic-peers.json
    mapfile -t shapes < <(model_args)
    quiet "$OUT/moe-peers.txt" timeout 240 "$B/moe-bench" "${shapes[@]}" --tokens "$PEER_TOKENS" \
        --min-ms 100 --json "$RAW/moe-peers.json"
    quiet "$RAW/moe-peers-graph.txt" timeout 120 "$B/moe-bench" "${shapes[@]}" --tokens 8,64 --graph \
        --min-ms 100 --json "$RAW/moe-peers-graph.json"
    cat "$RAW/moe-peers-graph.txt" >>"$OUT/moe-peers.txt"
    quiet "$RAW/torch-peers.txt" timeout 180 "$PY" bench/kernels/torch_ref.py "${shapes[@]}" \
        --tokens "$PEER_TOKENS" --min-ms 100 --json "$RAW/torch-peers.json"
    peers_site
    if [ ! -d "$PEERS/sonicmoe" ] && [ -n "${SONIC_JSON:-}" ]; then
        echo "run-on-gpu: SonicMoE's rows from $SONIC_JSON"
        sonic=$SONIC_JSON
    else
        # SonicMoE's own failures are rows of its JSON (the report shows them), not the stage's
        timeout 300 "${SONIC[@]}" "${shapes[@]}" --tokens "$PEER_TOKENS" --min-ms 100 --json "$sonic" \
            >"$RAW/sonic-peers.txt" 2>&1 || echo "run-on-gpu: sonic_ref.py exited $?"
        grep -m3 'failed' "$RAW/sonic-peers.txt"
    fi
    step "$PY" bench/kernels/report.py "$RAW/torch-peers.json" "$RAW/moe-peers.json" \
        "$RAW/moe-peers-graph.json" --peer "$sonic" --out "$OUT/peers.md" --brief
}

stage_e2e() {
    logged "$OUT/daemon.txt" "$PY" bench/daemon/bench_daemon.py --bin "$B" --suite transport \
        --json "$RAW/daemon.json" --logs "$RAW"
}

stage_merge() {
    logged "$OUT/merge.txt" "$PY" bench/daemon/bench_daemon.py --bin "$B" --suite merging \
        --json "$RAW/merge.json" --logs "$RAW"
}

stage_pytest() {
    MOED_BIN=$B/moed MOED_TEST_COMPUTE=bf16 logged "$OUT/pytest-gpu.log" \
        "$PY" -m pytest -q -rfEsxX -p no:cacheprovider tests/e2e/test_forward.py \
        tests/e2e/test_concurrency.py
}

stage_fp8() {
    local tool
    MOED_GPU_TEST_FP8_ONLY=1 logged "$OUT/gpu-fp8.log" timeout 420 "$B/test_cuda_backend"
    for tool in memcheck racecheck; do
        MOED_GPU_TEST_FP8_ONLY=1 MOED_GPU_TEST_QUICK=1 quiet "$RAW/sanitize-fp8-$tool.log" \
            timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 "$B/test_cuda_backend"
        tail -4 "$RAW/sanitize-fp8-$tool.log"
    done
}

stage_fp8-bench() {
    logged "$OUT/moe-fp8.txt" timeout 300 "$B/moe-bench" --weights bf16,fp8 \
        --tokens 8,64,512,4096,16384 --min-ms 100 --json "$RAW/moe-fp8.json"
    logged "$RAW/moe-fp8-graph.txt" timeout 120 "$B/moe-bench" --weights bf16,fp8 --tokens 8,64 \
        --graph --min-ms 100 --json "$RAW/moe-fp8-graph.json"
    logged "$RAW/moe-fp8-shapes.txt" timeout 120 "$B/moe-bench" --shape 4000,1400,64,6 \
        --shape 2880,2880,128,4 --weights bf16,fp8 --tokens 64,4096 --min-ms 100 \
        --json "$RAW/moe-fp8-shapes.json"
    cat "$RAW/moe-fp8-graph.txt" "$RAW/moe-fp8-shapes.txt" >>"$OUT/moe-fp8.txt"
    step "$PY" bench/kernels/report.py --fp8 "$RAW/moe-fp8.json" "$RAW/moe-fp8-graph.json" \
        "$RAW/moe-fp8-shapes.json" --out "$OUT/report-fp8.md"
}

stage_sparse() {
    local s shapes=(--shapes "mixtral,qwen3-30b-a3b,deepseek-v3")
    for s in "${SPARSE_SHAPES[@]}"; do shapes+=(--shape "$s"); done
    MOED_BIN=$B/moed MOED_TEST_COMPUTE=bf16 logged "$OUT/pytest-sparse24.log" \
        "$PY" -m pytest -q -rfEsxX -p no:cacheprovider tests/e2e/test_sparse24.py
    MOED_GPU_TEST_SPARSE_ONLY=1 logged "$OUT/gpu-sparse.log" timeout 300 "$B/test_cuda_backend"
    # every batch on wgmma.sp (Hopper), gathered and pre-permuted: the table takes it from 32 rows
    MOED_CUDA_SP24_KERNEL=sm90 MOED_GPU_TEST_SPARSE_ONLY=1 logged "$OUT/gpu-sparse-sm90.log" \
        timeout 300 "$B/test_cuda_backend"
    MOED_CUDA_SP24_KERNEL=sm90 MOED_CUDA_SP24_PREPERMUTE=1 MOED_GPU_TEST_SPARSE_ONLY=1 \
        quiet "$RAW/gpu-sparse-sm90-prepermuted.log" timeout 300 "$B/test_cuda_backend"
    MOED_GPU_TEST_SPARSE_ONLY=1 MOED_GPU_TEST_QUICK=1 quiet "$RAW/sanitize-sparse-memcheck.log" \
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/test_cuda_backend"
    tail -4 "$RAW/sanitize-sparse-memcheck.log"
    MOED_CUDA_SP24_KERNEL=sm90 MOED_GPU_TEST_SPARSE_ONLY=1 MOED_GPU_TEST_QUICK=1 \
        quiet "$RAW/sanitize-sparse-sm90-memcheck.log" \
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/test_cuda_backend"
    tail -4 "$RAW/sanitize-sparse-sm90-memcheck.log"
    logged "$OUT/moe-sparse.txt" timeout 300 "$B/moe-bench" "${shapes[@]}" --weights bf16,sparse24 \
        --tokens "$PEER_TOKENS" --min-ms 100 --json "$RAW/moe-sparse.json"
    logged "$RAW/moe-sparse-graph.txt" timeout 120 "$B/moe-bench" "${shapes[@]}" \
        --weights bf16,sparse24 --tokens 8,64 --graph --min-ms 100 --json "$RAW/moe-sparse-graph.json"
    cat "$RAW/moe-sparse-graph.txt" >>"$OUT/moe-sparse.txt"
    quiet "$RAW/torch-sparse.txt" timeout 240 "$PY" bench/kernels/torch_sparse_ref.py "${shapes[@]}" \
        --tokens "$PEER_TOKENS" --min-ms 100 --json "$RAW/torch-sparse.json"
    tail -3 "$RAW/torch-sparse.txt"
    local peer=()
    [ -f "$RAW/torch-sparse.json" ] && peer=(--peer "$RAW/torch-sparse.json")
    step "$PY" bench/kernels/report.py --sparse "$RAW/moe-sparse.json" "$RAW/moe-sparse-graph.json" \
        "${peer[@]}" --out "$OUT/sparse.md"
    cat "$OUT/sparse.md"
}

stage_dataplane() {
    df -h /dev/shm | tail -1
    logged "$OUT/gpu-parts.log" "$B/test_cuda_parts"
    logged "$OUT/gpu-ipc.log" "$B/test_ipc" "$B/moed"
    # shellcheck disable=SC2086  # DATAPLANE_ARGS is a list of arguments
    logged "$OUT/dataplane.txt" timeout 420 "$PY" bench/daemon/bench_dataplane.py --bin "$B" \
        --duration 1.5 --md "$OUT/dataplane.md" --json "$RAW/dataplane.json" --logs "$RAW" \
        ${DATAPLANE_ARGS:-}
}

stage_python() {
    logged "$OUT/python-torch.log" "$PY" tests/gpu/test_python_torch.py --bin "$B"
    [ "$stage_rc" -ne 77 ] || return 0 # no torch or no GPU: nothing to measure either
    # shellcheck disable=SC2086  # DATAPLANE_ARGS is a list of arguments
    logged "$OUT/python.txt" timeout 540 "$PY" bench/daemon/bench_dataplane.py --bin "$B" --python \
        --duration 1.5 --python-duration 1.5 --md "$OUT/python.md" --json "$RAW/python.json" \
        --logs "$RAW" ${DATAPLANE_ARGS:-}
}

stage_router() {
    MOED_GPU_TEST_ROUTER_ONLY=1 logged "$OUT/gpu-router.log" "$B/test_cuda_backend"
    MOED_BIN=$B/moed MOED_TEST_COMPUTE=bf16 logged "$OUT/pytest-hf.log" \
        "$PY" -m pytest -q -rfEsxX -p no:cacheprovider tests/e2e/test_hf_models.py
    logged "$OUT/hf-table.md" "$PY" tests/e2e/hf_models/table.py --moed "$B/moed" --backend cuda \
        --logs "$RAW"
}

stage_generate() {
    MOED_BIN=$B/moed MOED_TEST_COMPUTE=bf16 logged "$OUT/pytest-generate.log" \
        "$PY" -m pytest -q -rfEsxX -p no:cacheprovider tests/e2e/test_hf_generate.py
    logged "$OUT/generate.txt" timeout 480 "$PY" tests/e2e/hf_generate/run_gpu.py --moed "$B/moed" \
        --md "$OUT/generate.md" --logs "$RAW"
}

stage_droute() {
    logged "$OUT/gpu-droute.log" timeout 300 "$B/test_dev_route"
    step "$B/test_route_pack"
    local tool
    for tool in memcheck racecheck; do
        MOED_GPU_TEST_QUICK=1 quiet "$RAW/sanitize-droute-$tool.log" timeout 240 compute-sanitizer \
            --tool $tool --error-exitcode 9 "$B/test_dev_route"
        tail -4 "$RAW/sanitize-droute-$tool.log"
    done
}

stage_split() {
    MOED_SPLIT_DEVICES=0,0 logged "$OUT/gpu-split.log" timeout 300 "$B/test_split"
    MOED_SPLIT_DEVICES=0,0 MOED_GPU_TEST_QUICK=1 quiet "$RAW/sanitize-split-memcheck.log" \
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/test_split"
    tail -4 "$RAW/sanitize-split-memcheck.log"
}

# Exit 77 (counted as skipped) where fewer than $1 GPUs answer.
gpus_at_least() {
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$n" -ge "$1" ] && return 0
    echo "run-on-gpu: $n GPU(s) here; this stage needs $1"
    return 77
}

stage_two-gpu() {
    step gpus_at_least 2
    [ "$stage_rc" -eq 0 ] || return
    local md=$OUT/two-gpu.md
    MOED_SPLIT_DEVICES=0,1 logged "$OUT/gpu-split-01.log" timeout 300 "$B/test_split"
    MOED_SPLIT_DEVICES=0,1 MOED_CUDA_NO_PEER=1 MOED_GPU_TEST_QUICK=1 quiet \
        "$RAW/gpu-split-01-staged.log" timeout 300 "$B/test_split"
    tail -2 "$RAW/gpu-split-01-staged.log"
    logged "$RAW/moe-deepseek.txt" timeout 120 "$B/moe-bench" --shapes deepseek-v3 --tokens 8,4096 \
        --json "$RAW/moe-deepseek.json"
    echo "## moe-split-bench: DeepSeek-V3's layer whole on GPU 0 and split over GPUs 0,1" >"$md"
    logged "$RAW/split-bench.md" timeout 240 "$B/moe-split-bench" --devices 0,1 --tokens 8,4096 \
        --json "$RAW/split-bench.json"
    {
        cat "$RAW/split-bench.md"
        printf '\n## moe-bench (kernel only, one GPU)\n\n```\n'
        cat "$RAW/moe-deepseek.txt"
        printf '```\n\n## Through the daemons (moed-load on loopback)\n\n'
    } >>"$md"
    logged "$RAW/multi.md" timeout 420 "$PY" bench/daemon/bench_daemon.py --bin "$B" --suite multi \
        --duration 4 --json "$RAW/multi.json" --logs "$RAW"
    cat "$RAW/multi.md" >>"$md"
}

stage_links() {
    step gpus_at_least 2
    [ "$stage_rc" -eq 0 ] || return
    local nccl
    nccl=$("$PY" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    export MOED_NCCL_LIB=${MOED_NCCL_LIB:-$nccl/lib/libnccl.so.2}
    echo "links: NCCL from $MOED_NCCL_LIB"
    # a test that runs past 200 s dumps its threads' Python stacks (a call that never returns)
    MOED_BIN=$B/moed MOED_TEST_COMPUTE=bf16 logged "$OUT/pytest-links.log" timeout 420 \
        "$PY" -m pytest -q -rfEsxX -p no:cacheprovider -o faulthandler_timeout=200 \
        tests/e2e/test_links_gpu.py
    logged "$OUT/links-bench.log" timeout 540 "$PY" bench/daemon/bench_links.py --bin "$B" \
        --callers 2 --json "$OUT/links.json" --logs "$RAW"
}

stage_four-gpu() {
    step gpus_at_least 4
    [ "$stage_rc" -eq 0 ] || return
    local md=$OUT/four-gpu.md name spec devs
    MOED_SPLIT_DEVICES=0,1,2,3 MOED_GPU_TEST_QUICK=1 logged "$OUT/gpu-split-0123.log" timeout 300 \
        "$B/test_split"
    : >"$md"
    for name in deepseek-v3 gpt-oss-120b; do
        spec=layers=1,d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=bf16,seed=1,shared=1,shared_ff=2048
        [ "$name" = gpt-oss-120b ] && spec=layers=1,d=2880,ff=2880,experts=128,topk=4,act=swiglu,dtype=bf16,seed=1
        for devs in 0,1 0,1,2,3; do
            echo "## moe-split-bench: $name's layer whole on GPU 0 and split over GPUs $devs" >>"$md"
            logged "$RAW/split-$name-$devs.md" timeout 300 "$B/moe-split-bench" --spec "$spec" \
                --devices "$devs" --tokens 8,64,4096,16384 --routing uniform,zipf --min-ms 200 \
                --json "$RAW/split-$name-$devs.json"
            cat "$RAW/split-$name-$devs.md" >>"$md"
        done
    done
    printf '\n## Through the daemons (moed-load on loopback)\n\n' >>"$md"
    logged "$RAW/multi4.md" timeout 480 "$PY" bench/daemon/bench_daemon.py --bin "$B" --suite multi \
        --gpus 4 --duration 3 --json "$RAW/multi4.json" --logs "$RAW"
    cat "$RAW/multi4.md" >>"$md"
    printf '\n## A whole model on the host\n\n' >>"$md"
    logged "$RAW/model.md" timeout 1200 "$PY" bench/daemon/bench_model.py --bin "$B" --gpus 4 \
        --layers "${MODEL_LAYERS:-40}" --placements "${MODEL_PLACEMENTS:-split,layers}" \
        --json "$RAW/model.json" --logs "$RAW"
    cat "$RAW/model.md" >>"$md"
}

stage_other-gpu() {
    step gpus_at_least 2
    [ "$stage_rc" -eq 0 ] || return
    logged "$OUT/gpu-other-parts.log" timeout 300 "$B/test_cuda_parts"
    logged "$OUT/gpu-other-ipc.log" timeout 300 "$B/test_ipc" "$B/moed" two-gpu
    quiet "$RAW/sanitize-other-parts.log" timeout 300 compute-sanitizer --tool memcheck \
        --error-exitcode 9 "$B/test_cuda_parts"
    tail -4 "$RAW/sanitize-other-parts.log"
}

# MPS on while "$@" runs (callers on the daemon's GPU share one context with it), stopped after.
with_mps() {
    local mps=0
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        mps=1
    else
        echo "run-on-gpu: MPS not started: callers on the daemon's GPU share it by time slices"
    fi
    "$@"
    [ "$mps" -eq 0 ] || echo quit | nvidia-cuda-mps-control
}

doorbell_runs() {
    logged "$OUT/gpu-ring.log" timeout 300 "$B/test_ring_stream" "$B/moed"
    logged "$OUT/doorbell.txt" timeout 520 "$PY" bench/daemon/doorbell_grid.py --bin "$B" \
        --md "$OUT/doorbell.md" --json "$RAW/doorbell.json" --logs "$RAW"
}

stage_doorbell() {
    with_mps doorbell_runs
}

torch_op_runs() {
    logged "$OUT/gpu-ring-torch.log" timeout 150 "$PY" tests/gpu/test_ring_torch.py --bin "$B"
    [ "$stage_rc" -ne 77 ] || return 0 # no torch or no GPU: nothing to measure either
    logged "$OUT/torch-op.txt" timeout 300 "$PY" bench/daemon/bench_torch_op.py --bin "$B" \
        --md "$OUT/torch-op.md" --json "$RAW/torch-op.json" --logs "$RAW" --budget 240
}

stage_torch-op() {
    with_mps torch_op_runs
}

run_stage() {
    stage_name=$1 stage_rc=0
    echo "== $1 ($(date +%T))"
    "stage_$1"
    case $stage_rc in
    0) results+=("$(printf '%-9s passed' "$1")") ;;
    77)
        results+=("$(printf '%-9s skipped (exit 77: no GPU answered)' "$1")")
        [ "$worst" -eq 1 ] || worst=77
        ;;
    *)
        results+=("$(printf '%-9s FAILED (exit %d)' "$1" "$stage_rc")")
        worst=1
        ;;
    esac
}

main() {
    local stages=("$@") s
    [ $# -gt 0 ] || stages=(tests bench)
    for s in "${stages[@]}"; do
        if [[ " ${STAGES[*]} " != *" $s "* ]]; then
            echo "run-on-gpu: unknown stage '$s'; the stages are: ${STAGES[*]}" >&2
            return 2
        fi
    done
    mkdir -p "$RAW"
    worst=0
    run_stage device
    for s in "${stages[@]}"; do run_stage "$s"; done
    tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$RAW"
    echo "== summary ($(date +%T))"
    printf '%s\n' "${results[@]}" | tee "$OUT/summary.txt"
    return "$worst"
}

main "$@"
