"""`python -m ppserve.gpu_check --out DIR [--device cpu]`: see ppserve/gpu_check/__init__.py."""

import sys

from ppserve.gpu_check.runner import main

sys.exit(main())
