"""The report pages in a browser reuse the end-to-end tests' daemons: tests/e2e/conftest.py's
fixtures and helpers, loaded under a name of its own (this file is "conftest" too)."""
import importlib.util
import pathlib

_path = pathlib.Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
_spec = importlib.util.spec_from_file_location("e2e_conftest", _path)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

pytest_configure = e2e.pytest_configure
shared_daemon = e2e.shared_daemon
daemon = e2e.daemon
