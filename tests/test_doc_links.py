"""Every relative link in README.md and docs/ (pages, images, result files) points at a file that exists:
pages that moved (docs/history/) take their links with them."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 5
    broken = [
        f"{page.relative_to(ROOT)} -> {m.group(1)}"
        for page in pages
        for m in LINK.finditer(page.read_text())
        if not re.match(r"[a-z]+:", m.group(1)) and not (page.parent / m.group(1)).exists()
    ]
    assert broken == []
