"""The frame of the tree, checked on the sources and the build: the libraries match the folders, so
the C client's programs carry neither CUDA nor kernel code (moectl and libmoedclient no backend at
all, moed-load the CPU backend alone, for --verify); only the backend registry knows whether CUDA
was built; nothing under kernels/ or common/ includes a client header; one option engine parses
every program's command line; tests/gpu holds tests, bench/ the benchmarks and tools/gpu the GPU
machine's scripts; the name load_layer means the backend's call alone; and each method of the
protocol is answered from a file of its own, rpc.c keeping the server's life cycle.
"""

import re
import subprocess

import pytest

from conftest import BUILD, ROOT

CLIENT = {
    "moectl": BUILD / "client" / "c" / "moectl",
    "moed-load": BUILD / "client" / "c" / "moed-load",
    "libmoedclient.so": BUILD / "client" / "c" / "libmoedclient.so",
}
BENCHES = [BUILD / "bench" / "moe-bench", BUILD / "bench" / "moe-split-bench", BUILD / "bench" / "link-bench"]
CUDA_LIBS = re.compile(r"^lib(cuda|cudart|cublas|cublasLt|nvidia-\w+)\.so")
# The CUDA runtime's and driver's functions, as a program that links them defines them.
CUDA_SYMBOLS = re.compile(r"^(cuda[A-Z]\w*|__cuda\w+|cu[A-Z]\w*)$")
# The CUDA backend's code and its kernels' launchers.
KERNEL_SYMBOLS = re.compile(r"^(moed_cuda_\w+|moed_backend_cuda_\w+|cuda_\w+)$")


def defined(path):
    out = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def sections(path):
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return set(re.findall(r"\]\s+(\.\S+)", out))


def sources(*folders, exts=(".c", ".h", ".cu", ".cuh")):
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*")):
            if p.suffix in exts and p.is_file():
                yield p


@pytest.mark.parametrize("name", sorted(CLIENT))
def test_client_programs_carry_no_cuda(name):
    path = CLIENT[name]
    libs = [n for n in needed(path) if CUDA_LIBS.match(n)]
    assert not libs, f"{name} links {libs}"
    syms = defined(path)
    cuda = sorted(s for s in syms if CUDA_SYMBOLS.match(s) or KERNEL_SYMBOLS.match(s))
    assert not cuda, f"{name} carries CUDA or kernel code: {cuda[:12]}"
    assert ".nv_fatbin" not in sections(path), f"{name} carries the kernels' fatbin"


@pytest.mark.parametrize("name", ["moectl", "libmoedclient.so"])
def test_the_client_carries_no_backend(name):
    backend = sorted(s for s in defined(CLIENT[name]) if s.startswith(("moed_backend_", "cpu_")))
    assert not backend, f"{name} carries backend code: {backend[:12]}"


def test_moed_load_carries_the_cpu_backend_alone():
    syms = defined(CLIENT["moed-load"])
    assert "moed_backend_cpu_open" in syms, "moed-load's --verify needs the CPU backend"
    assert "moed_backend_open" not in syms, "moed-load carries the backend registry"


def test_only_the_registry_knows_whether_cuda_was_built():
    switching = [str(p.relative_to(ROOT)) for p in sources("common", "kernels", "server", "client", "bench")
                 if "MOED_HAVE_CUDA" in p.read_text()]
    assert switching == ["kernels/moed_registry.c"], switching


def test_kernels_and_common_include_no_client_header():
    client_headers = {p.name for p in sources("client", exts=(".h",))}
    found = []
    for p in sources("kernels", "common"):
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M):
            if name.rsplit("/", 1)[-1] in client_headers:
                found.append(f"{p.relative_to(ROOT)}: {name}")
    assert not found, found


def test_one_option_engine_parses_every_command_line():
    programs = [BUILD / "server" / "moed", CLIENT["moectl"], CLIENT["moed-load"]]
    programs += [b for b in BENCHES if b.exists()]
    for p in programs:
        syms = defined(p)
        assert "moed_opt_parse" in syms, f"{p.name} does not parse with common/moed_opt"
        assert "cli_parse" not in syms, f"{p.name} carries the old client engine"
    assert not list(ROOT.glob("client/c/cli/cli_opt.*")), "client/c/cli keeps an option parser"


def test_tests_benchmarks_and_gpu_scripts_live_apart():
    gpu = sorted(p.name for p in (ROOT / "tests" / "gpu").iterdir() if p.is_file())
    others = [n for n in gpu if not (n.startswith("test_") or n == "CMakeLists.txt")]
    assert not others, f"tests/gpu holds more than tests: {others}"
    for path in ("bench/kernels/moe_bench.c", "bench/kernels/report.py", "bench/daemon/bench_daemon.py",
                 "tools/gpu/run-on-gpu.sh", "tools/gpu/bundle.sh"):
        assert (ROOT / path).is_file(), path
    assert not (ROOT / "kernels" / "cuda" / "bench").exists()


def test_load_layer_names_the_backend_call_alone():
    """The vtable slot and moed_backend_load_layer: no function or type of that name elsewhere."""
    found = []
    for p in sources("common", "kernels", "server", "client", "bench", "tests"):
        text = p.read_text()
        for m in re.finditer(r"^\w[\w \*]*\bload_layer\s*\(|\bstruct\s+load_layer\b|\}\s*load_layer\s*;",
                             text, re.M):
            found.append(f"{p.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not found, found


def test_each_method_handler_lives_beside_the_others():
    """rpc.c keeps the server's life cycle and the calls' shared plumbing; every method of the
    protocol is answered from a file of its own (forward.c, getmodel.c, health.c, region_rpc.c)."""
    paths = {}
    for p in sources("server", exts=(".c",)):
        for m in re.finditer(r'\.path\s*=\s*"(/[\w.]+/\w+)"', p.read_text()):
            paths[m.group(1)] = p.name
    for method in ("/moed.v1.Moed/Forward", "/moed.v1.Moed/ForwardStream", "/moed.v1.Moed/GetModel",
                   "/moed.v1.Moed/Regions", "/moed.v1.Moed/ListRegions", "/grpc.health.v1.Health/Check",
                   "/grpc.health.v1.Health/Watch"):
        assert method in paths, f"no handler defines {method}"
        assert paths[method] != "rpc.c", f"{method} is answered in rpc.c, not beside the other methods"
