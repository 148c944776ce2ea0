"""The Markdown docs' relative links: every linked file exists, every `#anchor` is a heading there.

The README's lever table and the docs link into docs/hlm.md's dated sections; a heading renamed
without its links leaves the reader at the top of a 1,000-line file. Anchors are GitHub's: the
heading lower-cased, punctuation other than `-` and `_` dropped, spaces made hyphens, and a
repeated heading numbered `-1`, `-2`, ...
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of one heading's text (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> List[str]:
    """Every heading anchor of a Markdown file, fenced code blocks skipped."""
    seen: Dict[str, int] = {}
    out: List[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            a = github_anchor(m.group(2))
            out.append(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def relative_links(path: Path) -> List[Tuple[int, str]]:
    """(line number, target) of every link that is not a URL, outside fenced code."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, t) for t in LINK.findall(line) if not re.match(r"[a-z]+:", t)]
    return out


def test_anchor_rule_matches_githubs_on_headings_of_these_docs():
    # written out by hand from GitHub's rendering of such headings
    assert github_anchor("Measured, DS1 -> DS2: every run") == "measured-ds1---ds2-every-run"
    assert github_anchor("2026-11-27 (night): the beat and its template stretched in time?") == \
        "2026-11-27-night-the-beat-and-its-template-stretched-in-time"
    assert github_anchor("Cross-validation inside DS1: `hlmtune cv`") == "cross-validation-inside-ds1-hlmtune-cv"
    assert github_anchor("the beat's own interval") == "the-beats-own-interval"


def test_repeated_headings_are_numbered(tmp_path):
    f = tmp_path / "x.md"
    f.write_text("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n## Notes\n")
    assert anchors(f) == ["a", "notes", "notes-1", "notes-2"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_a_heading(doc: Path):
    broken = []
    for n, target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{doc.name}:{n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{doc.name}:{n}: {target}: no heading with that anchor in {dest.name}")
    assert not broken, "\n".join(broken)
