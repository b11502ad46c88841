"""``python -m perf.capacity``: the capacity benchmark (perf/capacity/command.py)."""

import sys

from perf.capacity.command import main

sys.exit(main())
