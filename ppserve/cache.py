"""Where ppserve keeps what it builds or measures on this machine: one root for all of it.

    $PPSERVE_CACHE_DIR, else $XDG_CACHE_HOME/ppserve, else ~/.cache/ppserve

Under it: the default model converted from its GGUF (ppserve/model/loader.py), the built CPU kernels
(kernels/, ppserve/model/ops/build.py) and the calibrated partition profiles (partition/,
ppserve/engine/calibration.py). Pure Python: read by the config layer, the loader and the engine alike.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("PPSERVE_CACHE_DIR"):
        return Path(os.environ["PPSERVE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ppserve"
