"""Comments say why: no issue numbers, dates or measured ratios in the library's comments and docstrings.

The history of a choice (which issue asked for it, what a run measured on which day) belongs in
CHANGELOG.md; a constant tuned by a benchmark names the benchmark instead. This scans the comments
and docstrings (string statements) of every .py file of the four library packages with ``tokenize``.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "consensus", "strategies", "meta_consensus")

RULES = {
    "an issue number": re.compile(
        r"\b(?:issues?|PR|pull request)\s*#?\d+\b|(?<![\w&/])#\d+\b", re.IGNORECASE
    ),
    "a date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?\b"),
    "a measured ratio": re.compile(
        r"\b\d+(?:\.\d+)?x\s+(?:against\s+\d+(?:\.\d+)?x\s+)?(?:the\s+)?floor\b"
        r"|\bratio\s+to\s+the\s+floor\b",
        re.IGNORECASE,
    ),
}
_BEFORE_STATEMENT = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def _texts(source: str):
    """(first line, text) of each comment and each string statement (docstrings) in source."""
    previous = tokenize.ENCODING
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string.lstrip("#")
        elif tok.type == tokenize.STRING and previous in _BEFORE_STATEMENT:
            yield tok.start[0], tok.string
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type


def violations(source: str, name: str) -> list[str]:
    """``name:line: what (the text)`` for each rule a comment or docstring of source breaks."""
    found = []
    for line, text in _texts(source):
        for what, pattern in RULES.items():
            for match in pattern.finditer(text):
                at = line + text.count("\n", 0, match.start())
                found.append(f"{name}:{at}: {what} ({' '.join(match.group().split())!r})")
    return found


def test_library_comments_say_why():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "history belongs in CHANGELOG.md, not in library comments:\n" + "\n".join(found)


SYNTHETIC = '''"""A module.

Chosen after issue 19; rerun on 2026-11-25.
"""

LIMIT = 16  # the former limit came from #17


def f():
    """Selection at n = 514: 1.7x the
    floor against 6.8x."""
    return "issue 5 in a plain string is data, not a comment"
'''


def test_the_guard_can_fail():
    assert violations(SYNTHETIC, "synthetic.py") == [
        "synthetic.py:3: an issue number ('issue 19')",
        "synthetic.py:3: a date ('2026-11-25')",
        "synthetic.py:6: an issue number ('#17')",
        "synthetic.py:10: a measured ratio ('1.7x the floor')",
    ]


@pytest.mark.parametrize(
    "clean",
    [
        "# probabilities are floored at 1e-12 so the log stays finite\n",
        "# the floor of 1 neighbour; a 2x wider block\n",
        "# see docs/robust.md#17-rows and 0x7F800000\n",
        '"""n = 16 rows, 2048-1024 columns; floor(x) rounds down."""\n',
    ],
)
def test_the_guard_leaves_reasons_alone(clean):
    assert violations(clean, "clean.py") == []
