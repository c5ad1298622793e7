"""``python -m ftmem.cli`` is the ``ftmem`` command."""

import sys

from ftmem.cli import main

sys.exit(main())
