"""`ppserve bench sweep` as a script: see benchmarks/README.md for the settings used and the figures."""

import sys

from ppserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], "sweep"))
