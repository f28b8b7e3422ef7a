"""Every relative link in README.md and docs/*.md resolves: the file exists and, for a #anchor,
the target page has that heading (GitHub's anchors). docs/history/ is kept as it was written and
is not checked as a source; links into it are. The reference pages carry no diary headings.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
# Headings of a diary, not of a reference page (issue #40).
DIARY = re.compile(
    r"session \d+|tried, not adopted|not adopted|(first|second|third|fourth|fifth) round",
    re.IGNORECASE,
)


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link inside a shell example is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _headings(path: Path) -> list[str]:
    return [
        m.group(2) for line in _prose(path.read_text()) if (m := re.match(r"(#+)\s+(.*)", line))
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, markup and punctuation dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for heading in _headings(path):
        slug = _slug(heading)
        out.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path.read_text()) for m in LINK.finditer(line)]


def test_slugs_follow_github() -> None:
    assert _slug("Tail latency across consolidations (`bench.tail_latency`)") == (
        "tail-latency-across-consolidations-benchtail_latency"
    )
    assert _slug("Retention's own cost") == "retentions-own-cost"
    assert _slug("### `session.open`".lstrip("# ")) == "sessionopen"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(source: Path) -> None:
    broken = []
    for target in _links(source):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], broken


def test_reference_pages_have_no_diary_headings() -> None:
    diary = [
        f"{source.relative_to(ROOT)}: {heading}"
        for source in SOURCES
        for heading in _headings(source)
        if DIARY.search(heading)
    ]
    assert diary == [], diary


def test_the_readme_links_its_docs() -> None:
    # The README names docs pages as links (checked above), so a renamed heading fails here.
    targets = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    for page in ("docs/architecture.md", "docs/protocol.md", "docs/benchmarks.md", "docs/vlm.md"):
        assert page in targets, page


def test_benchmarks_page_is_a_reference() -> None:
    page = ROOT / "docs" / "benchmarks.md"
    assert page.stat().st_size < 30_000
    text = page.read_text()
    # The history moved, unchanged, and the page links it.
    assert "history/benchmarks-2026.md" in text
    # One section per maintained benchmark, each with its command.
    for module in sorted(p.stem for p in (ROOT / "bench").glob("*.py")):
        if module in ("__init__", "driver"):
            continue
        assert f"bench.{module}" in text, module
    assert "reserves ceil(max_model_len" not in text  # admission is by footprint now
