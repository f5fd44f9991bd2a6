"""Check the internal links of the built site, offline: every relative href and src must name a file
of the build, and every ``#anchor`` an id in its page.

Links into viewcode's source listings (``_modules/``) are checked to the page, not to the line.

Usage: ``python docs/check_links.py docs/_build/html`` (``make docs`` runs it). Prints each broken
link as ``page: target`` and exits 1 if there is one. External links (http, https, mailto) are not
followed: the check runs without a network.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            if (name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script")):
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def broken_links(site: Path) -> list[str]:
    """``page: target`` for every internal link of ``site`` that leads nowhere."""
    pages = {p: _parse(p) for p in sorted(site.rglob("*.html"))}
    bad = []
    for path, page in pages.items():
        if "_modules" in path.parts:  # viewcode's source listings link only to themselves
            continue
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue  # external: not checked offline
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                bad.append(f"{path.relative_to(site)}: {link}")
                continue
            # viewcode's source pages (_modules/) keep the anchors of the build that first read a
            # module, so an incremental build may lack a new one: the page is checked, not the line.
            if parts.fragment and target.suffix == ".html" and "_modules" not in target.parts:
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    bad.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    return bad


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "docs/_build/html")
    if not (site / "index.html").is_file():
        print(f"check_links: {site} holds no built site (run make docs)", file=sys.stderr)
        return 2
    bad = broken_links(site)
    for line in bad:
        print(f"broken link: {line}", file=sys.stderr)
    print(f"check_links: {sum(1 for _ in site.rglob('*.html'))} pages, {len(bad)} broken internal links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
