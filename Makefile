# Two commands that work on a fresh machine with Python 3.11+:
#   make run   - the main job on its embedded default (meta-consensus run: digits, 8 nodes, ~1 min)
#   make test  - ruff (check, format), the import contract, mypy and every pytest test but the slow tier, on 2 xdist workers
#                (fresh clone, 2 cores: about 3.5 min of venv setup, 3 min of linters and mypy, 8-9 min of pytest)
#   make test-slow - the slow tier: whole training runs, full benchmark settings, real pretrained models (CI runs it after make test)
#   make test-fast - make test without the multiprocess and notebook tests (under 3 min of pytest on 2 cores)
#   make docs  - the documentation site in docs/_build/html: warnings are errors, internal links checked (about 1.5 min fresh on 2 cores, seconds when little changed)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-slow test-fast lint bench bench-quick clean data docs docs-screenshots

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "meta-consensus needs Python 3.11 or newer")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

# A finished runs/default/ is moved aside to runs/default.old-K (never deleted); an interrupted one
# (a checkpoint before its last round, e.g. after Ctrl-C) is kept, and the command to resume it shown.
run: $(STAMP)
	@last=$$(ls runs/default/checkpoints 2>/dev/null | grep -E '^[0-9]+$$' | sort -n | tail -1); \
	rounds=$$(sed -n 's/^rounds = \([0-9]*\)$$/\1/p' runs/default/config.toml 2>/dev/null); \
	if [ -n "$$last" ] && [ "$$last" != "$$rounds" ]; then \
	  echo "meta-consensus: runs/default holds an interrupted run (checkpoint of round $$last of $${rounds:-?}):" \
	    "continue it with '$(BIN)/meta-consensus run --resume', or start over with" \
	    "'$(BIN)/meta-consensus run --overwrite' (moves it aside to runs/default.old-K)" >&2; exit 2; \
	fi
	$(BIN)/meta-consensus run --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

# The slow tier (marker in pyproject.toml): .ci/run runs it after make test, with the pretrained
# model the real-model tests need fetched first (meta-consensus models fetch smollm2).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m slow

# The markers are declared in pyproject.toml ([tool.pytest.ini_options]).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not multiprocess and not notebooks"

# Every benchmark that `python -m benchmarks` lists (benchmarks/speed, quality, tuning), each in
# its own process, stopping at the first failure; fashion_mnist needs the data of `make data`.
bench: $(STAMP) data
	$(BIN)/python -m benchmarks all

bench-quick: $(STAMP) data
	$(BIN)/python -m benchmarks all --quick

# Fashion-MNIST's IDX files (Debian's dataset-fashion-mnist, under /usr/share/datasets/fashion-mnist/).
data:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then echo "Fashion-MNIST: already in /usr/share/datasets/fashion-mnist/"; \
	elif command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y dataset-fashion-mnist; \
	  else sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist; fi; \
	else echo "no apt-get here: put the four Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, ...) in a folder and set META_CONSENSUS_FASHION_MNIST=<folder> (or the task option data_dir)"; exit 1; fi

DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev,docs]"
	@touch $(DOCS_STAMP)

# The site: results pages equal to their data (python -m benchmarks publish --check), Sphinx with
# warnings as errors (the notebooks rendered, not executed: with the outputs the notebook tests
# stored in build/notebooks when there are any, else as their source), then every internal link
# checked offline. MathJax is served with the site (docs/fetch_mathjax.sh).
docs: $(DOCS_STAMP)
	docs/fetch_mathjax.sh
	$(BIN)/python -m benchmarks publish --check
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	$(BIN)/python docs/check_links.py docs/_build/html

# The built site in headless Chromium (Debian's chromium): screenshots in docs/_build/screenshots.
docs-screenshots: docs
	$(BIN)/python docs/screenshots.py docs/_build/html docs/_build/screenshots

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache docs/_build build/notebooks build/mathjax
