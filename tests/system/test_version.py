"""One version: the metadata, ``meta_consensus.__version__`` and ``meta-consensus --version`` agree."""

import importlib.metadata
import re

import pytest

import meta_consensus
from meta_consensus import cli


def test_version_is_the_installed_metadata():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", meta_consensus.__version__)
    assert meta_consensus.__version__ == importlib.metadata.version("meta-consensus")


def test_cli_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"meta-consensus {meta_consensus.__version__}"
