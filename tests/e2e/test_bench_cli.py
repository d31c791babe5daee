"""The kernel benchmarks' command lines (moe-bench, moe-split-bench), parsed by the same option table
as moectl and moed-load: --help lists every option with its default, every bad word is a usage error
(exit 2) naming the flag, and the command lines tools/gpu/ and bench/ give them parse. Nothing here needs a
GPU: the run lines are given with CUDA_VISIBLE_DEVICES empty, so a line that parses ends at "no CUDA
device" (moe-bench: exit 1; moe-split-bench: skipped, 77) and one that does not, at exit 2.
"""

import os
import subprocess

import pytest

from conftest import BUILD

BENCH = BUILD / "bench" / "moe-bench"
SPLIT = BUILD / "bench" / "moe-split-bench"

pytestmark = pytest.mark.skipif(not BENCH.exists(),
                                reason=f"{BENCH} is not built (a build without nvcc has no benchmarks)")


def run(exe, *args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, env=env)


def test_help_lists_every_option_with_its_default():
    p = run(BENCH, "--help")
    assert p.returncode == 0, p.stderr
    for opt in ("--shapes LIST", "--shape d,ff,E,k", "--weights LIST", "--tokens LIST",
                "--routing LIST", "--kernel LIST", "--min-ms MS", "--cublas", "--graph",
                "--json FILE", "--help"):
        assert opt in p.stdout, (opt, p.stdout)
    assert "(default 8,64,512,4096,16384)" in p.stdout and "(default 200)" in p.stdout, p.stdout
    p = run(SPLIT, "--help")
    assert p.returncode == 0, p.stderr
    for opt in ("--spec SPEC", "--tokens LIST", "--devices LIST", "--routing LIST", "--io device|host",
                "--min-ms MS", "--json FILE"):
        assert opt in p.stdout, (opt, p.stdout)


# The lines tools/gpu/run-on-gpu.sh and bench/daemon/bench_*.py run.
RUN_LINES = [
    ["--tokens", "8,64,512,4096,16384", "--json", "moe.json"],
    ["--tokens", "64,4096", "--routing", "zipf,hot,empty"],
    ["--tokens", "4096,16384", "--kernel", "sm80,sm90,sm90p", "--cublas"],
    ["--shapes", "mixtral,qwen3-30b-a3b,deepseek-v3", "--shape", "2880,2880,128,4", "--shape",
     "2048,1408,60,4", "--tokens", "8,64", "--graph", "--min-ms", "100"],
    ["--weights", "bf16,fp8", "--shape", "4000,1400,64,6", "--tokens", "8"],
    ["--shapes", "deepseek-v3", "--tokens", "8,4096", "--min-ms=50"],
]


@pytest.mark.parametrize("args", RUN_LINES, ids=lambda a: " ".join(a)[:40])
def test_run_lines_parse(args):
    p = run(BENCH, *args)
    assert p.returncode == 1 and "no CUDA device" in p.stderr, (p.returncode, p.stderr)


@pytest.mark.parametrize("args,names", [
    (["--shape", "1,2,3"], "--shape 1,2,3"),
    (["--shape", "64,64,4,5"], "--shape 64,64,4,5"),          # k > E
    (["--shape", "64,64,4,2x"], "--shape 64,64,4,2x"),
    (["--tokens", "8,x"], "--tokens x"),
    (["--tokens", "0"], "--tokens 0"),
    (["--routing", "skewed"], "--routing skewed"),
    (["--kernel", "sm70"], "--kernel sm70"),
    (["--weights", "fp4"], "--weights fp4"),
    (["--shapes", "llama"], "unknown shape llama"),
    (["--min-ms", "0"], "--min-ms 0"),
    (["--min-ms"], "--min-ms needs a value"),
    (["--graph=1"], "--graph takes no value"),
    (["--frobnicate"], "unknown option --frobnicate"),
])
def test_bad_words_are_usage_errors_naming_the_flag(args, names):
    p = run(BENCH, *args)
    assert p.returncode == 2 and names in p.stderr and "moe-bench --help" in p.stderr, p.stderr


def test_split_bench_lines():
    p = run(SPLIT, "--devices", "0,1", "--tokens", "8,4096", "--min-ms", "300")
    assert p.returncode == 77 and "no CUDA device" in p.stderr, (p.returncode, p.stderr)
    for args, names in ((["--devices", "0"], "--devices needs two or more"),
                        (["--min-ms", "-1"], "--min-ms -1"),
                        (["--io", "pinned"], "--io: 'pinned' is not one of device|host"),
                        (["--routing", "uniform,skewed"], "--routing skewed"),
                        (["--spec", "layers=1,d=0"], "--spec")):
        p = run(SPLIT, *args)
        assert p.returncode == 2 and names in p.stderr, (args, p.stderr)
