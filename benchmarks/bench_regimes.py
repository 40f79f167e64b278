"""`ppserve bench regimes` as a script: five microbatch formations on eleven load regimes, in the simulator.

See ppserve/bench/regimes.py for the regimes and benchmarks/README.md for a run's table.

    python benchmarks/bench_regimes.py [--reduced] [--only conv-8,decode-heavy] [--out DIR] [--workers N]
"""

import sys

from ppserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], "regimes"))
