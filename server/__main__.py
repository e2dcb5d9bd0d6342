"""`python -m server` is the `graphserve` command."""

import sys

from server.cli import main

sys.exit(main())
