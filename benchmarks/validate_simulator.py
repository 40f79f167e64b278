"""`ppserve bench validate` as a script: run the real PP=2 pipeline on workload A, fit a simulator
profile from its spans, simulate a held-out workload B and run it for real, compare per-stage busy
time and p50 TBT (see benchmarks/README.md)."""

import sys

from ppserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], "validate"))
