"""``python -m consensus run|report ...``: the same as the ``meta-consensus`` command."""

import sys

from consensus.cli import main

sys.exit(main())
