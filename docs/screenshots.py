"""Look at the built site in a real browser: headless Chromium screenshots and checks of five pages.

Usage: ``python docs/screenshots.py [SITE [OUT]]`` (defaults ``docs/_build/html``,
``docs/_build/screenshots``; ``make docs-screenshots``). The site is served on loopback by a
throwaway HTTP server; Debian's ``chromium`` (``apt-get install chromium``) loads each page with
JavaScript on and a fresh profile, writes ``OUT/<name>.png`` and dumps the DOM after the scripts
ran. Each page is then checked:

* **math rendered**: every ``span.math`` / ``div.math`` of the page holds a MathJax
  ``mjx-container`` (MathJax is served with the site, so this works offline), and the page that
  must show math has some;
* **images loaded**: every ``<img>`` was served with status 200 (the server's log), or is an
  embedded ``data:image/png`` that decodes to a PNG (notebook outputs);
* **no raw Markdown**: the visible text (code blocks aside) has no fences, directives, link
  syntax or heading hashes that the Markdown parser should have consumed.

Exits 1 naming every failed check, 2 when Chromium or the site is missing.
"""

from __future__ import annotations

import base64
import functools
import http.server
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path


@dataclass(frozen=True)
class Shot:
    name: str
    path: str  # relative to the site root
    needs_math: bool = False
    needs_image: bool = False


PAGES = (
    Shot("landing", "index.html"),
    Shot("api_krum", "api/generated/consensus.krum.html"),
    Shot("guide_convex_math", "convex.html", needs_math=True),
    Shot("notebook_quickstart", "notebooks/01_quickstart.html"),
    Shot("results_system", "results/meta_consensus.html", needs_image=True),
)

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=10000",  # let MathJax and the theme's scripts finish
)

# Markdown that should never reach a reader: fences, MyST directives and roles, links, headings.
RAW_MARKDOWN = (
    (re.compile(r"```"), "a code fence"),
    (re.compile(r"\{(toctree|eval-rst|include|code-cell|note|math)\}"), "a MyST directive"),
    (re.compile(r"\]\((?:[^)\s]+)\)"), "Markdown link syntax"),
    (re.compile(r"(?m)^\s*#{1,6} \w"), "a heading's hashes"),
    (re.compile(r"(?m)^:::"), "a colon fence"),
    (re.compile(r"\$\$"), "display math delimiters"),
)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class _Log(http.server.SimpleHTTPRequestHandler):
    served: list[tuple[str, int]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.served.append((self.path.split("?")[0], int(code) if str(code).isdigit() else 0))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass


@contextmanager
def serve(site: Path) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """The site on http://127.0.0.1:<free port>/; yields the base URL and the log of (path, status)."""
    served: list[tuple[str, int]] = []
    handler = type("Handler", (_Log,), {"served": served})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", served
    finally:
        server.shutdown()
        server.server_close()


def _browser(binary: str, profile: Path, *args: str, timeout: float = 120) -> str:
    out = subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"chromium exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


class _Dom(HTMLParser):
    """The images, the math elements and the visible text (code aside) of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.math_total = 0
        self.math_rendered = 0
        self.text: list[str] = []
        self._skip = 0  # depth inside pre / code / script / style / mjx-container
        self._math_depth: list[int] = []
        self._depth = 0
        self._math_has_mjx = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._depth += 1
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "img" and a.get("src"):
            self.images.append(a["src"] or "")
        if tag in ("span", "div") and "math" in classes and not self._math_depth:
            self.math_total += 1
            self._math_depth.append(self._depth)
            self._math_has_mjx = False
        if tag == "mjx-container" and self._math_depth:
            self._math_has_mjx = True
        if tag in ("pre", "code", "script", "style", "mjx-container", "textarea") or self._skip:
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            self._skip -= 1
        if self._math_depth and self._math_depth[-1] == self._depth:
            self._math_depth.pop()
            self.math_rendered += self._math_has_mjx
        self._depth -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


def _png_ok(data_uri: str) -> bool:
    try:
        raw = base64.b64decode(data_uri.split(",", 1)[1], validate=False)
    except (ValueError, IndexError):
        return False
    return raw.startswith(b"\x89PNG\r\n\x1a\n") and len(raw) > 100


def check_page(shot: Shot, dom: str, served: list[tuple[str, int]]) -> list[str]:
    """The problems of one page, as sentences (empty: it looks right)."""
    parsed = _Dom()
    parsed.feed(dom)
    problems = []
    if shot.needs_math and parsed.math_total == 0:
        problems.append("no math on a page that has math")
    if parsed.math_rendered < parsed.math_total:
        missing = parsed.math_total - parsed.math_rendered
        problems.append(f"{missing} of {parsed.math_total} formulas not rendered")
    ok_paths = {path for path, status in served if status == 200}
    local = [src for src in parsed.images if not src.startswith("data:")]
    if shot.needs_image and not parsed.images:
        problems.append("no image on a page that has plots")
    page_dir = "/" + shot.path.rsplit("/", 1)[0] + "/" if "/" in shot.path else "/"
    for src in local:
        if src.startswith(("http://", "https://")):
            path = "/" + src.split("/", 3)[3] if src.count("/") >= 3 else src
        else:
            path = posixpath.normpath(page_dir + src) if not src.startswith("/") else src
        if path.split("#")[0] not in ok_paths:
            problems.append(f"image not loaded: {src}")
    for src in parsed.images:
        if src.startswith("data:image/png") and not _png_ok(src):
            problems.append("an embedded PNG does not decode")
    text = "".join(parsed.text)
    for pattern, what in RAW_MARKDOWN:
        hit = pattern.search(text)
        if hit:
            context = text[max(0, hit.start() - 40) : hit.end() + 40].replace("\n", " ")
            problems.append(f"raw Markdown ({what}): ...{context}...")
    return problems


def take(site: Path, out: Path, pages: tuple[Shot, ...] = PAGES) -> dict[str, list[str]]:
    """Screenshot and check every page; page name -> its problems."""
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium not found (Debian: apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, list[str]] = {}
    with serve(site) as (base, served), tempfile.TemporaryDirectory(prefix="docs-chromium-") as tmp:
        for shot in pages:
            if not (site / shot.path).is_file():
                report[shot.name] = [f"{shot.path} is not in the built site"]
                continue
            url = base + shot.path
            png = out / f"{shot.name}.png"
            _browser(binary, Path(tmp) / "shot", f"--screenshot={png}", "--window-size=1280,1600", url)
            before = len(served)
            dom = _browser(binary, Path(tmp) / "dom", "--dump-dom", url)
            problems = check_page(shot, dom, served[before:])
            if not png.is_file() or png.stat().st_size < 10_000:
                problems.append("the screenshot is missing or blank")
            report[shot.name] = problems
    return report


def main(argv: list[str]) -> int:
    site = Path(argv[0]) if argv else Path("docs/_build/html")
    out = Path(argv[1]) if len(argv) > 1 else Path("docs/_build/screenshots")
    if not (site / "index.html").is_file():
        print(f"screenshots: {site} holds no built site (run make docs)", file=sys.stderr)
        return 2
    try:
        report = take(site, out)
    except FileNotFoundError as e:
        print(f"screenshots: {e}", file=sys.stderr)
        return 2
    for name, problems in report.items():
        print(f"{name}: {'ok' if not problems else '; '.join(problems)}  ({out / (name + '.png')})")
    return 1 if any(report.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
