"""`ppserve bench regimes` as a script: four microbatch formations on nine load regimes, in the simulator.

See ppserve/bench/regimes.py for the regimes and benchmarks/README.md for a run's table.

    python benchmarks/bench_regimes.py [--reduced] [--only conv-8,decode-heavy] [--out DIR]
"""

import sys

from ppserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], "regimes"))
