"""`python -m graphserve` is the `graphserve` command."""

import sys

from graphserve.server.cli import main

sys.exit(main())
