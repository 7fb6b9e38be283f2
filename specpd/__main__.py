"""`python -m specpd ...` is the `specpd` command."""
import sys

from specpd.server.cli import main

sys.exit(main())
