"""`python -m sim --port 8100 --profile fast`."""

import sys

from sim.cli import main

sys.exit(main(sys.argv[1:]))
