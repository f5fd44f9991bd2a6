"""The package's one version.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), and so do ``meta_consensus.__version__``
and ``meta-consensus --version``.
"""

__version__ = "0.1.0"
