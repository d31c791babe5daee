"""The package's modules import each other in one direction: none imports a module that imports it
back, lazily (inside a function) or not. Read from the sources, so an import hidden in a function
counts too."""

import ast
import pathlib

import moed

PACKAGE = pathlib.Path(moed.__file__).parent
MODULES = {p.stem: p for p in PACKAGE.glob("*.py")}
PACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def imports(name):
    """The package's modules that module `name` imports (`from . import X`, `from .X import Y`,
    `import moed.X`; a name of the package itself is its __init__)."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                out |= {a.name if a.name in MODULES or a.name in PACKAGES else "__init__" for a in node.names}
            else:
                out.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "moed":
            out.add(node.module.split(".")[1] if "." in node.module else "__init__")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "moed":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
    return {m for m in out if m in MODULES and m != name}


def test_no_module_imports_one_that_imports_it_back():
    graph = {m: imports(m) for m in MODULES}
    assert graph["fleet"] and graph["aio"], "the reading of imports found none"
    cycles = []

    def visit(m, path):
        for n in sorted(graph[m]):
            if n in path:
                cycles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in done:
                visit(n, path + [n])
        done.add(m)

    done = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"
