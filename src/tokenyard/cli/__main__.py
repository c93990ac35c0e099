"""`python -m tokenyard.cli`: what `tokenyard` runs."""

import sys

from tokenyard.cli.main import main

sys.exit(main())
