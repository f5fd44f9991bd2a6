"""``python -m meta_consensus run|report ...``: the same as the ``meta-consensus`` command."""

import sys

from meta_consensus.cli import main

sys.exit(main())
