#!/usr/bin/env bash
# Two GPUs on the GPU machine: run-on-gpu.sh's split stage (two placements on GPU 0, which one GPU
# can run), its two-gpu stage (GPUs 0 and 1: the split within one output rounding of one GPU, with
# and without peer access, the benchmarks and tables in $OUT/two-gpu.md) and its other-gpu stage
# (CUDA regions on a GPU moed does not compute on, with and without peer access). Exit 77 when no stage failed
# but the two-GPU ones were skipped (fewer than two GPUs); the stages, their files and the
# environment are run-on-gpu.sh's.
exec bash "$(dirname "$0")/run-on-gpu.sh" split two-gpu other-gpu
