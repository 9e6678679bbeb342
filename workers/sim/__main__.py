"""`python -m workers.sim --port 8100 --profile fast`."""

import sys

from workers.sim.cli import main

sys.exit(main(sys.argv[1:]))
