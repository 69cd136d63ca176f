"""`python -m serving.cli ...`: the `metrale` command line."""

import sys

from serving.cli.metrale import main

sys.exit(main())
