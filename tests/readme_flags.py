"""docs/operations.md carries `moed --help` verbatim under "Flags", between two markers; this finds
that block (for the test that checks it, tests/e2e/test_cli.py) and rewrites it
(`make readme-flags`).

    python3 tests/readme_flags.py build/server/moed     rewrites the block in docs/operations.md
"""

import pathlib
import re
import subprocess
import sys

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BLOCK = re.compile(r"(<!-- moed --help -->\n```text\n)(.*?)(```\n<!-- end moed --help -->)", re.S)


def flags_block(text):
    """The help text the page carries, or None if it lacks the marked block."""
    m = BLOCK.search(text)
    return m.group(2) if m else None


def main(moed):
    help_text = subprocess.run([moed, "--help"], check=True, capture_output=True, text=True).stdout
    text = PAGE.read_text()
    if flags_block(text) is None:
        sys.exit(f"{PAGE} lacks the <!-- moed --help --> block")
    PAGE.write_text(BLOCK.sub(lambda m: m.group(1) + help_text + m.group(3), text))
    print(f"{PAGE}: flags block updated from {moed} --help")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/server/moed")
