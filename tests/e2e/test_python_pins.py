"""The Python client at the lowest versions it claims: a throwaway virtual environment with exactly
the lower bounds of client/python/pyproject.toml (grpcio, numpy, and ml_dtypes of the bf16 extra
for the oracle), without protobuf, runs test_python_client.py against real daemons. The client is
taken from the source tree (PYTHONPATH), as it runs from an installed wheel.

Cost: the environment is kept in the build folder and made again only when the pins change, so a
CI run pays one pip install (about 10-30 s, 25 MB of wheels) and the tests themselves (about 10 s).
The ASan stage skips it: it runs test_python_client.py itself, and the pins are the point here.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT

PYPROJECT = ROOT / "client" / "python" / "pyproject.toml"


def lowest_pins():
    """'name==version' for every lower bound of the dependencies and of the bf16 extra."""
    text = PYPROJECT.read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    bf16 = re.search(r"^bf16 = \[(.*?)\]", text, re.M | re.S).group(1)
    pins = re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', deps + bf16)
    assert {name for name, _ in pins} == {"grpcio", "numpy", "ml_dtypes"}, pins
    return [f"{name}=={version}" for name, version in pins]


@pytest.mark.skipif("ASAN_OPTIONS" in os.environ, reason="checked once, in the e2e stage")
def test_the_client_works_at_its_lowest_pins():
    pins = lowest_pins() + ["pytest==8.4.2", "h2==4.4.1"]  # h2: the tests' held calls (held.py)
    venv = BUILD / "venv-lowest-pins"
    python = venv / "bin" / "python"
    stamp = venv / "pins.txt"
    if not stamp.exists() or stamp.read_text() != "\n".join(pins):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--only-binary", ":all:", *pins],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"pip could not install {pins}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        stamp.write_text("\n".join(pins))
    probe = ("import importlib.util, grpc, numpy, ml_dtypes; "
             "print(grpc.__version__, numpy.__version__, ml_dtypes.__version__, "
             "importlib.util.find_spec('google') is not None)")  # no protobuf
    got = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert got == [p.split("==")[1] for p in pins[:3]] + ["False"], got
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client" / "python"), "MOED_BUILD_DIR": str(BUILD)}
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "tests/e2e/test_python_client.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"at {pins}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"\b(\d+) passed", r.stdout) and int(re.search(r"\b(\d+) passed", r.stdout).group(1)) >= 10
