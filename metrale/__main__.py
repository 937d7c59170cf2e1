"""``python -m metrale`` is ``met``."""

import sys

from metrale.cli import main

sys.exit(main())
