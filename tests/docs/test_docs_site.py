"""The built site, looked at in headless Chromium (docs/screenshots.py), and its internal links.

The site is built with warnings as errors into docs/_build/html (incrementally: what `make docs`
built is reused), then served on loopback; the landing page, the API page of ``consensus.krum``, a
user-guide page with math, a notebook and a results page are screenshotted and checked (math
rendered by the MathJax served with the site, images loaded, no raw Markdown). Skipped only when
Debian's ``chromium`` or the ``docs`` extra is not installed (CI installs both). The checks
themselves are tested on hand-made pages below, so a check that could not fail would show here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import check_links  # noqa: E402
import screenshots  # noqa: E402

SITE = ROOT / "docs" / "_build" / "html"

MATH_PAGE = screenshots.Shot("math", "guide.html", needs_math=True)


def test_check_page_sees_unrendered_math_and_raw_markdown():
    raw = '<p>See [the round](round.md) and</p><div class="math notranslate">$$ x $$</div><p>```</p>'
    problems = screenshots.check_page(MATH_PAGE, f"<html><body>{raw}</body></html>", [])
    assert any("not rendered" in p for p in problems)
    assert any("link syntax" in p for p in problems)
    assert any("code fence" in p for p in problems)


def test_check_page_accepts_a_rendered_page():
    page = (
        '<p>Weights <span class="math notranslate"><mjx-container>w</mjx-container></span> and '
        '<img src="../_images/plot.png"></p><pre>```python\n# a comment\n```</pre>'
    )
    shot = screenshots.Shot("guide", "results/page.html", needs_math=True, needs_image=True)
    assert screenshots.check_page(shot, page, [("/_images/plot.png", 200)]) == []
    # The same image never requested (or a 404): not loaded.
    assert screenshots.check_page(shot, page, [("/_images/plot.png", 404)]) == [
        "image not loaded: ../_images/plot.png"
    ]


def test_check_links_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "index.html").write_text('<a href="a.html#here">a</a> <a href="gone.html">b</a>')
    (tmp_path / "a.html").write_text('<h1 id="there">A</h1><img src="_images/x.png">')
    assert sorted(check_links.broken_links(tmp_path)) == [
        "a.html: _images/x.png",
        "index.html: a.html#here (no such anchor)",
        "index.html: gone.html",
    ]


@pytest.mark.slow
def test_site_builds_and_renders_in_chromium(tmp_path):
    if screenshots.chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; CI installs it)")
    fetch = subprocess.run([str(ROOT / "docs" / "fetch_mathjax.sh")], capture_output=True, text=True)
    assert fetch.returncode == 0, fetch.stderr
    # Offline, math renders only with the MathJax served beside the site (npm's mathjax package).
    assert (ROOT / "build" / "mathjax" / "tex-chtml.js").is_file(), fetch.stderr
    sphinx = shutil.which("sphinx-build", path=str(Path(sys.executable).parent))
    if sphinx is None:
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]'; CI installs it)")
    build = subprocess.run(
        [sphinx, "-W", "--keep-going", "-q", "-b", "html", "docs", str(SITE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert build.returncode == 0, build.stderr[-5000:]
    assert check_links.broken_links(SITE) == []
    report = screenshots.take(SITE, tmp_path)
    assert report == {shot.name: [] for shot in screenshots.PAGES}, report
    for shot in screenshots.PAGES:
        assert (tmp_path / f"{shot.name}.png").stat().st_size > 10_000
