#!/usr/bin/env bash
# Expert parallelism on the GPU machine: run-on-gpu.sh's split stage (two
# placements on GPU 0, which one GPU can run) and its two-gpu stage (GPUs 0 and 1: the split
# bit-identical to one GPU with and without peer access, the benchmarks and tables in
# $OUT/two-gpu.md). Exit 77 when no stage failed but the two-GPU one was skipped (fewer than two
# GPUs); the stages, their files and the environment are run-on-gpu.sh's.
exec bash "$(dirname "$0")/run-on-gpu.sh" split two-gpu
