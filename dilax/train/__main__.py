"""``python -m dilax.train``: see :func:`dilax.train.main`."""

import sys

from dilax.train.cli import main

sys.exit(main())
