"""`python -m tandem.operator ...` runs the operator, as `tandem operator ...` does."""

import sys

from tandem.operator.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
