"""``python -m tests._support.chaos``: the chaos runner's command line (see the package)."""

import sys

from tests._support.chaos import main

sys.exit(main())
