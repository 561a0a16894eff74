"""`python -m kiln.cli ...`: the `kiln` command without its console script."""

import sys

from kiln.cli import main

sys.exit(main())
