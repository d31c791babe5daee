"""tools/gpu/run-on-gpu.sh, the GPU machine's test run, checked here without a GPU: its stages run
against stand-in programs (MOED_GPU_DIR: the tests stage's programs exiting as told, an nvidia-smi and
a compute-sanitizer on PATH) so that a failing, skipping or missing program must show in the summary
and the exit status; and its pytest stage against the real daemon, which serves on the CPU here, so
that a CUDA run that fell back to the CPU must fail.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import MOED_BIN, ROOT

SCRIPT = ROOT / "tools" / "gpu" / "run-on-gpu.sh"
TESTS_STAGE = ("test_cuda_backend", "test_link_kernels")  # the programs its tests stage runs


def fake(path, rc, out=""):
    path.write_text(f"#!/bin/sh\necho '{out or path.name}'\nexit {rc}\n")
    path.chmod(0o755)


@pytest.fixture
def gpu(tmp_path):
    """Runs the script with stand-ins: gpu(stages, tests=rc, smi=rc, sanitizer=rc, setup=fn) -> (exit
    status, output, summary lines), $OUT being tmp_path / "out"; tests=None leaves the tests stage's
    programs out of the bundle; setup(bundle folder) adds to it."""

    def run(*stages, tests=0, smi=0, sanitizer=None, packed=False, setup=None):
        bundle, tools, out = tmp_path / "gpu", tmp_path / "tools", tmp_path / "out"
        for d in (bundle / "bin", bundle / "lib", bundle / "py", tools):
            d.mkdir(parents=True, exist_ok=True)
        for name in TESTS_STAGE if tests is not None else ():
            fake(bundle / "bin" / name, tests)
        (bundle / "bin" / "moed").unlink(missing_ok=True)
        (bundle / "bin" / "moed").symlink_to(MOED_BIN)
        fake(tools / "nvidia-smi", smi, "name, memory.total\nStand-in GPU, 80 GiB")
        if sanitizer is None:  # runs the program it is given, as the real one does
            (tools / "compute-sanitizer").write_text('#!/bin/sh\nshift 4\nexec "$@"\n')
        else:
            fake(tools / "compute-sanitizer", sanitizer)
        (tools / "compute-sanitizer").chmod(0o755)
        if packed:  # as bundle.sh leaves it, beside a stale bin/ that the archive must replace
            subprocess.run(["tar", "czf", "bundle.tgz", "bin", "lib", "py"], cwd=bundle, check=True)
            for name in TESTS_STAGE:
                fake(bundle / "bin" / name, 1)
        if setup:
            setup(bundle)
        env = {**os.environ, "OUT": str(out), "MOED_GPU_DIR": str(bundle),
               "MOED_GPU_PYTHON": sys.executable, "PATH": f"{tools}:{os.environ['PATH']}"}
        p = subprocess.run(["bash", str(SCRIPT), *stages], capture_output=True, text=True, env=env,
                           timeout=300)
        summary = (out / "summary.txt").read_text().splitlines() if (out / "summary.txt").exists() else []
        (out / "summary.txt").unlink(missing_ok=True)
        return p.returncode, p.stdout + p.stderr, summary

    return run


def result(summary, stage):
    line = next((l for l in summary if l.split()[0] == stage), None)
    assert line, f"{stage} missing from the summary {summary}"
    return line.split()[1]


@pytest.mark.parametrize("tests_rc,want,status", [(0, "passed", 0), (1, "FAILED", 1), (77, "skipped", 77)])
def test_a_stage_result_is_its_programs(gpu, tests_rc, want, status):
    code, out, summary = gpu("tests", tests=tests_rc)
    assert code == status, out
    assert result(summary, "device") == "passed" and result(summary, "tests") == want, summary


def test_a_packed_bundle_is_unpacked_afresh(gpu):
    code, out, summary = gpu("tests", tests=0, packed=True)
    assert code == 0 and result(summary, "tests") == "passed", out


def stand_in_bench(path, ms):
    """A moe-bench that writes one row taking `ms` to its --json file."""
    row = {"shape": "mixtral", "weights": "bf16", "T": 4096, "routing": "uniform", "kernel": "auto", "pairs": 8192,
           "active_experts": 8, "bm": 128, "ms": ms, "tflops": 1.0, "gbs": 1.0, "stages_ms": {"up": ms / 2, "down": ms / 4}}
    doc = json.dumps({"device": "Stand-in GPU", "sm": 90, "matmul_tflops": 800.0, "fp8_matmul_tflops": 1500.0,
                      "copy_gbs": 4000.0, "runs": [row]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/sh\nwhile [ "$1" != --json ]; do shift; done\n' f"echo '{doc}' > \"$2\"\n")
    path.chmod(0o755)


def test_ab_times_the_base_build_against_this_one(gpu, tmp_path):
    """The ab stage runs the base bundle's moe-bench and this one's in turn and tables the medians;
    without a base bundle it fails saying how to make one."""
    def both(bundle):
        stand_in_bench(bundle / "bin" / "moe-bench", 1.0)
        stand_in_bench(bundle / "base-src" / "bin" / "moe-bench", 1.25)
        (bundle / "base-src" / "lib").mkdir(exist_ok=True)
        subprocess.run(["tar", "czf", str(bundle / "base.tgz"), "bin", "lib"], cwd=bundle / "base-src", check=True)

    code, out, summary = gpu("ab", setup=both)
    assert code == 0 and result(summary, "ab") == "passed", out
    md = (tmp_path / "out" / "ab.md").read_text()
    assert "3 runs of the base build and 3 of the new" in md, md
    assert "| mixtral | bf16 | 4096 | uniform | auto | 1.250 | 1.000 | 1.250x | 1.250x | 1.250x | 0.0% | 0.0% |" in md, md

    code, out, summary = gpu("ab", setup=lambda bundle: (bundle / "base.tgz").unlink())
    assert code == 1 and result(summary, "ab") == "FAILED", out
    assert "tools/gpu/bundle.sh --base REV" in out, out


def test_a_failed_stage_fails_the_run_and_the_others_still_run(gpu):
    code, out, summary = gpu("sanitize", "tests", sanitizer=9)
    assert code == 1, out
    assert result(summary, "sanitize") == "FAILED" and result(summary, "tests") == "passed", summary
    assert "FAILED (exit 9)" in "\n".join(summary)


def test_the_sanitizer_stage_counts_its_program(gpu):
    assert gpu("sanitize", tests=77)[0] == 77
    code, out, summary = gpu("sanitize", tests=3)
    assert code == 1 and result(summary, "sanitize") == "FAILED", out


def test_no_device_fails_even_when_every_stage_skips(gpu):
    code, out, summary = gpu("tests", tests=77, smi=9)
    assert code == 1, out
    assert result(summary, "device") == "FAILED" and result(summary, "tests") == "skipped", summary


def test_a_missing_program_fails_its_stage(gpu):
    code, out, summary = gpu("tests", tests=None)
    assert code == 1 and result(summary, "tests") == "FAILED", out
    assert "exit 127" in "\n".join(summary)


def test_an_unknown_stage_runs_nothing(gpu):
    code, out, summary = gpu("tests", "bogus")
    assert code == 2 and "unknown stage 'bogus'" in out and summary == [], out
    assert "== tests" not in out


def test_pytest_stage_fails_on_a_daemon_that_fell_back_to_the_cpu(gpu):
    """moed built here serves on the CPU: in the GPU run's CUDA mode every test must fail."""
    code, out, summary = gpu("pytest")
    assert code == 1 and result(summary, "pytest") == "FAILED", out
    assert "moed serves on the cpu backend" in out, out[-3000:]


def test_python_stage_skips_where_torch_or_a_gpu_is_missing(gpu):
    """CI has neither: the stage says skipped and measures nothing."""
    code, out, summary = gpu("python")
    assert code == 77 and result(summary, "python") == "skipped", out
    assert "test_python_torch: skipped" in out and "bench_dataplane" not in out, out


def test_generate_stage_fails_on_a_daemon_that_fell_back_to_the_cpu(gpu):
    """The replayed generations must come from a CUDA daemon; the run with the model on cuda skips
    itself without torch and a GPU (CI has neither)."""
    code, out, summary = gpu("generate")
    assert code == 1 and result(summary, "generate") == "FAILED", out
    assert "moed serves on the cpu backend" in out, out[-3000:]
    assert "generate: skipped (needs torch and transformers" in out, out[-3000:]
