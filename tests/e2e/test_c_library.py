"""libmoedclient as a program outside this tree sees it: the public header compiles alone (C11 and
C++, given only its own folder), the shared library exports exactly the functions the header marks
MOEDC_EXTERN and nothing else (no core, protobuf-c or internal symbol), and README's C example
compiles against the build and gets an answer from a real daemon; so does the region example of
docs/regions.md, through shared memory (nothing left in /dev/shm afterwards). Inside it (read from the sources): no
file includes one that includes it back, and the fleet is a sibling of the one-daemon client:
moedclient.c calls nothing moedc_fleet.c defines, and no private header declares what both define.
"""

import pathlib
import re
import subprocess

import pytest

from conftest import BUILD, ROOT

INCLUDE = ROOT / "client" / "c" / "include"
HEADER = INCLUDE / "moedclient.h"
LIBDIR = BUILD / "client" / "c"
LIB = ROOT / "client" / "c" / "lib"


def sanitizer_flags():
    """The flags a program linking an ASan/UBSan build of the library needs too."""
    cache = BUILD / "CMakeCache.txt"
    on = cache.exists() and "MOED_SANITIZE:BOOL=ON" in cache.read_text()
    return ["-fsanitize=address,undefined"] if on else []


def declared():
    """The functions the public header exports."""
    return set(re.findall(r"MOEDC_EXTERN\s[^;]*?\b(moedc_\w+)\s*\(", HEADER.read_text()))


def test_the_header_declares_the_api():
    names = declared()
    for f in ("moedc_connect", "moedc_forward", "moedc_forward_start", "moedc_queue_next",
              "moedc_info", "moedc_health", "moedc_code_to_grpc", "moedc_strerror"):
        assert f in names, f"{f} is not marked MOEDC_EXTERN"
    prototypes = re.findall(r"^(?:MOEDC_EXTERN\s+)?[a-z][\w ]*\*?\s*\**(moedc_\w+)\(", HEADER.read_text(),
                            re.M)
    unmarked = set(prototypes) - names
    assert not unmarked, f"public functions without MOEDC_EXTERN: {sorted(unmarked)}"


@pytest.mark.parametrize("compiler,flags", [
    ("cc", ["-x", "c", "-std=c11"]),
    ("c++", ["-x", "c++", "-std=c++11"]),
], ids=["c11", "c++11"])
def test_header_compiles_alone(tmp_path, compiler, flags):
    includes = re.findall(r'^#include\s*([<"][^>"]+[>"])', HEADER.read_text(), re.M)
    assert set(includes) <= {"<stdbool.h>", "<stddef.h>", "<stdint.h>"}, includes
    src = tmp_path / "alone.c"
    src.write_text('#include "moedclient.h"\n'
                   "int alone(void);\n"
                   "int alone(void) { moedc_error e = { MOEDC_EINVAL, \"\" }; return e.code; }\n")
    p = subprocess.run([compiler, *flags, "-Wall", "-Wextra", "-Werror", "-pedantic", "-I",
                        str(INCLUDE), "-c", str(src), "-o", str(tmp_path / "alone.o")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr


def test_shared_library_exports_exactly_the_public_api():
    so = LIBDIR / "libmoedclient.so"
    assert so.exists(), f"{so} was not built"
    p = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    exported = {line.split()[-1] for line in p.stdout.splitlines() if line.strip()}
    if sanitizer_flags():  # instrumentation adds its own (e.g. __odr_asan markers); not ours
        exported = {s for s in exported if not s.startswith("__")}
    assert exported == declared(), (f"exported but not public: {sorted(exported - declared())}; "
                                    f"public but not exported: {sorted(declared() - exported)}")


def doc_example(page="README.md", lead=r"C \(`libmoedclient`, public header"):
    text = (ROOT / page).read_text()
    m = re.search(r"^" + lead + r".*?```c\n(.*?)```", text, re.S | re.M)
    assert m, f"{page} has no C example after '{lead}'"
    return m.group(1)


def build_example(tmp_path, source):
    src = tmp_path / "example.c"
    src.write_text(source)
    exe = tmp_path / "example"
    p = subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", *sanitizer_flags(), str(src),
                        "-I", str(INCLUDE), "-L", str(LIBDIR), "-lmoedclient",
                        f"-Wl,-rpath,{LIBDIR}", "-o", str(exe)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return exe


def test_docs_region_example_answers_through_shared_memory(daemon, tmp_path):
    exe = build_example(tmp_path, doc_example("docs/regions.md", r"C \(`libmoedclient`\): open a session"))
    d = daemon("--synthetic", "layers=1,d=256,ff=64,experts=8,topk=2,dtype=f32", "--threads", "1")
    p = subprocess.Popen([str(exe), d.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert re.fullmatch(r"y\[0\]\[0\] = \S+ \(res.output == y: 1\)\n", out), out
    assert not re.fullmatch(r"y\[0\]\[0\] = 0 .*\n", out)  # computed from the region's rows
    # the library names its objects /moedc-PID-...; other tests' clients may be running meanwhile
    left = [n.name for n in pathlib.Path("/dev/shm").iterdir() if n.name.startswith(f"moedc-{p.pid}-")]
    assert not left, left


def test_readme_example_compiles_and_answers(daemon, tmp_path):
    exe = build_example(tmp_path, doc_example())
    # the example's shapes: d_model 256, experts 0..7, f32 hidden states of zeros
    d = daemon("--synthetic", "layers=1,d=256,ff=64,experts=8,topk=2,dtype=f32", "--threads", "1")
    p = subprocess.run([str(exe), d.address], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(r"y\[0\]\[0\] = 0, compute \d+ us\n", p.stdout), p.stdout
    with_other_shape = daemon("--synthetic", "layers=1,d=64,ff=64,experts=8,topk=2", "--threads", "1")
    p = subprocess.run([str(exe), with_other_shape.address], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("INVALID_ARGUMENT: "), p.stderr


def code(path):
    """A source file without its comments."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)


def defines(path):
    """The functions with external linkage a .c file defines."""
    text, out = code(path), set()
    for m in re.finditer(r"^([a-z][^;{}()\n#]*?)\b(moedc_\w+)\s*\(", text, re.M):
        rest = text[m.end():]
        if not m.group(1).startswith(("static", "typedef")) and rest.find("{") < rest.find(";"):
            out.add(m.group(2))
    return out


def test_no_file_of_the_library_includes_one_that_includes_it_back():
    files = {p.name: p for p in [*LIB.glob("*.[ch]"), HEADER]}
    graph = {n: set(re.findall(r'^#include\s*"([^"]+)"', code(p), re.M)) & set(files) for n, p in files.items()}
    assert graph["moedc_fleet.c"], "the reading of includes found none"

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    assert not [n for n in graph if n in reach(n)], "include cycles"


def test_the_fleet_is_a_sibling_of_the_one_daemon_client():
    defined = {p.name: defines(p) for p in LIB.glob("*.c")}
    assert defined["moedc_fleet.c"] and "moedc_forward" in defined["moedclient.c"], "no definitions read"
    calls = {n for n in defined["moedc_fleet.c"] if re.search(rf"\b{n}\b", code(LIB / "moedclient.c"))}
    assert not calls, f"moedclient.c calls the fleet's {sorted(calls)}"
    for h in LIB.glob("*.h"):
        declared = set(re.findall(r"\b(moedc_\w+)\s*\(", code(h)))
        both = {c for c in ("moedclient.c", "moedc_fleet.c") if defined[c] & declared}
        assert len(both) < 2, f"{h.name} declares functions of both moedclient.c and moedc_fleet.c"
