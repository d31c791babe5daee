"""Build hook of moed-client: generates the protobuf and gRPC stubs from the repository's protos.

The protos live once, in ../../proto, shared with the daemon and the C client; copying them into
the package would let the copies drift. So build_py runs grpc_tools.protoc over them into
moed/_proto/ (git-ignored) before the usual build. The descriptors keep their canonical file names
(moed/v1/moed.proto, grpc/health/v1/health.proto) so they coexist with other stubs of the same
protos in one process; only the generated gRPC modules' imports are rewritten to point inside
moed._proto, because `moed.v1` would resolve to this package and `grpc.health.v1` to grpcio.
An sdist carries the generated files, so building from it needs no ../../proto.

The doorbell (moed.ring) calls libmoedclient, the C client, through ctypes: build_py puts a copy
into moed/_lib/. $MOED_CLIENT_LIB, when set at build time, names a library to copy (a build's
build/client/c/libmoedclient.so); else, in the repository with cmake on the PATH, the library is
built with CMake into ../../build-python (kept, so a reinstall rebuilds only what changed). Where
neither works (no cmake, no gRPC development files) the package installs without it, and the
doorbell says at run time how to get one.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["moed/v1/moed.proto", "grpc/health/v1/health.proto"]
OUT_DIR = os.path.join(HERE, "moed", "_proto")
PACKAGES = ["moed", "moed._proto", "moed._proto.moed", "moed._proto.moed.v1", "moed._proto.grpc",
            "moed._proto.grpc.health", "moed._proto.grpc.health.v1"]
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
LIB = "libmoedclient.so"
IMPORT_RE = re.compile(r"^from (moed\.v1|grpc\.health\.v1) import ", re.M)


def generate_stubs():
    if not os.path.isdir(PROTO_DIR):
        if os.path.isfile(os.path.join(OUT_DIR, "moed", "v1", "moed_pb2.py")):
            return  # building from an sdist, which carries the stubs
        raise RuntimeError(f"moed-client: no protos at {PROTO_DIR} and no generated stubs in "
                           f"{OUT_DIR}: build from the moed repository (client/python) or an sdist")
    from grpc_tools import protoc  # the build requirement grpcio-tools

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}"] + [os.path.join(PROTO_DIR, p) for p in PROTOS])
        if rc != 0:
            raise RuntimeError(f"moed-client: grpc_tools.protoc failed ({rc}) on {PROTOS} in {PROTO_DIR}")
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        for pkg in PACKAGES[1:]:
            d = os.path.join(HERE, *pkg.split("."))
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "__init__.py"), "w").close()
        for root, _, files in os.walk(tmp):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), tmp)
                with open(os.path.join(tmp, rel)) as f:
                    text = IMPORT_RE.sub(r"from moed._proto.\1 import ", f.read())
                with open(os.path.join(OUT_DIR, rel), "w") as f:
                    f.write(text)


def client_library():
    """The path of a libmoedclient to package, or None (saying why on stderr)."""
    given = os.environ.get("MOED_CLIENT_LIB")
    if given:
        if not os.path.isfile(given):
            raise RuntimeError(f"moed-client: $MOED_CLIENT_LIB names {given}, which is no file")
        return given
    if not os.path.isfile(os.path.join(ROOT, "client", "c", "CMakeLists.txt")) or not shutil.which("cmake"):
        print("moed-client: no libmoedclient packaged (needs the moed repository and cmake): the "
              "doorbell (moed.RingClient) will need $MOED_CLIENT_LIB", file=sys.stderr)
        return None
    build = os.path.join(ROOT, "build-python")
    steps = [["cmake", "-S", ROOT, "-B", build, "-DMOED_WITH_CUDA=OFF", "-DMOED_BUILD_TESTS=OFF",
              "-DCMAKE_BUILD_TYPE=Release"],
             ["cmake", "--build", build, "--target", "moedclient", "-j", str(os.cpu_count() or 2)]]
    for cmd in steps:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode:
            print(f"moed-client: building libmoedclient failed ({' '.join(cmd)}):\n{p.stdout[-3000:]}\n"
                  f"the package installs without it: the doorbell (moed.RingClient) will need "
                  f"$MOED_CLIENT_LIB", file=sys.stderr)
            return None
    return os.path.join(build, "client", "c", LIB)


class BuildPyWithStubs(build_py):
    # finalize_options, not run: egg_info and sdist list the package files through build_py
    # before any run(), and the _proto packages must exist by then.
    def finalize_options(self):
        generate_stubs()
        super().finalize_options()

    def run(self):
        super().run()
        lib = client_library()
        if lib:
            dest = os.path.join(self.build_lib, "moed", "_lib")
            os.makedirs(dest, exist_ok=True)
            shutil.copy(lib, os.path.join(dest, LIB))  # follows the soname link: the file itself


setup(packages=PACKAGES, cmdclass={"build_py": BuildPyWithStubs})
