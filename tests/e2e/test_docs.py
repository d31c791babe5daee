"""The documents: README.md is the front page (at most 300 lines: what moed is, the two commands,
one example per client, the layout, links) and docs/ holds the rest, indexed by docs/README.md.
Every relative link between them reaches a file, and every #anchor a heading of it; README's
layout section is the map of the tree (every top-level folder and every folder below one, and
nothing that is not there); and neither the code nor the documents cite a tracker's issue or a
lab-notes step by number (they cite the docs' pages and sections instead).
"""

import re
import subprocess

from conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
# "issue" and a number (also "Issue N's"), "NOTES step N", "NOTES, steps N to M", "NOTES, issue N, step M"
CITATION = re.compile(r"\bissue #?[0-9]+|\bNOTES,? (issue [0-9]+, )?steps? [0-9]+", re.I)
CODE = ("*.c", "*.h", "*.cu", "*.cuh", "*.py", "*.sh", "*.proto", "*.yaml", "*CMakeLists.txt",
        "*.md", "Makefile", ".ci/run")


def pages():
    return [README] + sorted(DOCS.glob("*.md"))


def prose(path):
    """The file's text without its fenced code blocks (links and headings are read outside them)."""
    return FENCE.sub("", path.read_text())


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6} (.+)$", prose(path), re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_readme_is_the_front_page():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; the rest belongs in docs/"
    for topic in ("## Two commands", "## Examples", "## Repository layout", "## Documentation"):
        assert topic in README.read_text(), f"README.md lacks '{topic}'"


def test_docs_index_links_every_page():
    index = DOCS / "README.md"
    assert index.is_file(), "docs/README.md (the index of docs/) is missing"
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(prose(index))}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p.name not in linked]
    assert not missing, f"docs/README.md does not link {missing}"
    from_readme = {m.group(1).split("#")[0] for m in LINK.finditer(prose(README))}
    assert "docs/README.md" in from_readme, "README.md does not link the docs' index"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in pages():
        for m in LINK.finditer(prose(page)):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def tracked():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def layout_paths():
    """The folders README's layout block names: `top/` or `top/sub/` at the start of a line, and
    `sub/` indented (by at most 4 blanks) under the latest line that named one."""
    text = README.read_text().split("## Repository layout", 1)[1]
    block = re.search(r"```text\n(.*?)```", text, re.S).group(1)
    named, top = set(), None
    for line in block.splitlines():
        m = re.match(r"^( {0,4})(\.?[\w.-]+(?:/[\w.-]+)*/)(\s|$)", line)
        if not m:
            continue
        path = m.group(2).rstrip("/")
        if m.group(1):
            path = f"{top}/{path}"
        else:
            top = path
        named.add(path)
    return named


def test_readme_layout_is_the_map_of_the_tree():
    files = tracked()
    folders = {"/".join(f.split("/")[:n]) for f in files for n in (1, 2) if f.count("/") >= n}
    named = layout_paths()
    unnamed = sorted(folders - named)
    assert not unnamed, f"README's layout leaves out {unnamed}"
    absent = sorted(p for p in named if not (ROOT / p).is_dir())
    assert not absent, f"README's layout names folders the tree lacks: {absent}"


def test_no_code_or_document_cites_a_tracker():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *CODE],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    found = []
    for name in out.stdout.split():
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if CITATION.search(line):
                found.append(f"{name}:{n}: {line.strip()}")
    assert not found, "cite the docs (page and section), not a tracker:\n" + "\n".join(found)
