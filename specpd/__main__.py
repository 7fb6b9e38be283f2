"""`python -m specpd ...` is the `specpd` command."""
import sys

from specpd.server.cli import main

if __name__ == "__main__":  # (a spawned process, e.g. a tensor-parallel rank, imports this module too)
    sys.exit(main())
