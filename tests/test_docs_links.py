# SPDX-License-Identifier: Apache-2.0
"""Every relative link and #anchor in README.md and docs/*.md resolves: the
file exists, and the anchor is one of the target's headings as GitHub
renders it (lower case, punctuation dropped, spaces to hyphens, repeats
numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of ``path``."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto:


def test_anchors_follow_githubs_rules():
    assert anchors(ROOT / "docs" / "results.md") >= {
        "how-to-read-the-figures", "esps-mask-rows-do-not-pay-on-smollm2",
        "esp-at-b8-under-the-benchmarks-own-engine", "bf16"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)
