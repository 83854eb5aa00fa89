"""Every relative link of README.md and docs/ reaches a file that exists, and its anchor a heading.

Links are markdown's `[text](target)` and `![alt](target)` outside code (fences and inline code);
web addresses are not followed. An anchor (`page.md#section`, `#section`) must match a heading of
the target by GitHub's rule: lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` for
repeats.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        plain = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _shown(path: pathlib.Path) -> pathlib.Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links(page: pathlib.Path) -> list[str]:
    """The relative links of `page` that lead nowhere, each as `target (why)`."""
    broken: list[str] = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {_shown(dest)})")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {_shown(dest)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: pathlib.Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} links to what is not there"


def test_the_checker_sees_a_broken_link_and_anchor(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Two words, here\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#two-words-here) [web](https://example.com/x.md) `[code](nope.md)`\n"
        "[gone](nope.md) [bad anchor](a.md#three) [self](#nowhere)\n```\n[fenced](nope.md)\n```\n"
    )
    assert [line.split(" ")[0] for line in broken_links(page)] == ["nope.md", "a.md#three", "#nowhere"]
