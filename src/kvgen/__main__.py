"""`python -m kvgen` is the same as the `kvgen` command."""

import sys

from kvgen.cli import main

sys.exit(main())
