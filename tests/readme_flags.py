"""README.md carries `moed --help` verbatim under "Flags", between two markers; this finds that
block (for the test that checks it, tests/e2e/test_cli.py) and rewrites it (`make readme-flags`).

    python3 tests/readme_flags.py build/server/moed     rewrites the block in README.md
"""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- moed --help -->\n```text\n)(.*?)(```\n<!-- end moed --help -->)", re.S)


def flags_block(text):
    """The help text the README carries, or None if it lacks the marked block."""
    m = BLOCK.search(text)
    return m.group(2) if m else None


def main(moed):
    help_text = subprocess.run([moed, "--help"], check=True, capture_output=True, text=True).stdout
    text = README.read_text()
    if flags_block(text) is None:
        sys.exit(f"{README} lacks the <!-- moed --help --> block")
    README.write_text(BLOCK.sub(lambda m: m.group(1) + help_text + m.group(3), text))
    print(f"{README}: flags block updated from {moed} --help")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/server/moed")
