"""``python -m stream_persia ...`` is the ``stream-persia`` console script."""

import sys

from stream_persia.launch.cli import main

sys.exit(main())
