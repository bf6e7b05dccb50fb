"""The docs a newcomer reads: a README of at most 200 lines, and no broken relative link (file or
#anchor) in README.md or docs/*.md. Reads files only: no subprocess, no import of localsgd.
(tests/test_docs_names.py checks the names and paths they mention.)"""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(path: str) -> list[str]:
    """The file's lines outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                out.append(CODE_SPAN.sub("``", line.rstrip("\n")))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped,
    spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(line)
            if m:
                slug = _slug(m.group(2))
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: str) -> list[str]:
    return [m.group(1) for line in _prose_lines(path) for m in LINK.finditer(line)]


def test_readme_is_at_most_200_lines():
    with open(README, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= 200, f"README.md has {n} lines; move detail to docs/"


def test_readme_activates_the_venv_before_its_first_python_command():
    """A newcomer copies the first example as written: outside the environment `make install`
    made, `python -m localsgd.train` stops with `No module named 'hydra'`."""
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("python -m localsgd"))
    assert any("source .venv/bin/activate" in line for line in lines[:first])


def test_docs_pages_exist():
    assert len(DOCS) > 1, "docs/*.md is missing"


def _broken(path: str) -> list[str]:
    """The relative links in `path` whose file or #anchor does not exist."""
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else os.path.normpath(
            os.path.join(os.path.dirname(path), file_part))  # fmt: skip
        if not os.path.exists(dest):
            broken.append(f"{target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = _broken(path)
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + ", ".join(broken)


def test_the_link_check_finds_the_links_and_reports_the_broken_ones(tmp_path):
    """The check above passes for a page whose links it never saw: it must see them."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n"
        "[ok](other.md) [ok anchor](other.md#a-code-heading) [here](#title) "
        '![img](other.md "t") [web](https://example.com/missing.md)\n'
        "[gone](missing.md) [bad anchor](other.md#nope) [bad here](#nothing)\n"
        "`[in code](missing-too.md)`\n"
        "```\n[fenced](missing-three.md)\n```\n"
    )
    assert _broken(str(page)) == [
        "missing.md (no such file)",
        "other.md#nope (no heading with that anchor)",
        "#nothing (no heading with that anchor)",
    ]
    # and the real pages hold relative links for it to check
    assert sum(not re.match(r"^[a-z][a-z0-9+.-]*:", t) for p in DOCS for t in _links(p)) > 10


def test_slug_matches_github():
    assert _slug("Overlapped averaging (`sync.overlap`)") == "overlapped-averaging-syncoverlap"
    assert _slug("Compressed averaging (`sync.comm_dtype`)") == (
        "compressed-averaging-synccomm_dtype")  # fmt: skip
    assert _slug("Stopping: Ctrl-C and SIGTERM") == "stopping-ctrl-c-and-sigterm"
