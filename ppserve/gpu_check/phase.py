"""One phase in its own process: `python -m ppserve.gpu_check.phase NAME --out DIR --device D --options JSON`.

The runner starts one per phase. This makes the device image's missing packages unimportable, runs the
phase module's `run(ctx)`, and writes DIR/NAME.json whatever happens (ok, error with its traceback,
`not_run` with the reason it had nothing to run, the seconds it took); a phase killed by its time
limit or the OOM killer leaves no JSON, which the runner reports as such.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppserve.gpu_check import ABSENT_ON_DEVICE, PHASES
from ppserve.gpu_check.verdicts import FAIL, phase_status


@dataclass
class Context:
    """What a phase knows of the run: its name, the device, the output folder and the runner's options."""

    name: str
    device: str  # "cuda" or "cpu"
    out: Path
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def models_dir(self) -> Path:
        """Checkpoints built by one phase and reused by the next (same run; the runner's --models-dir,
        kept out of the output folder: the 8B-shaped one is ~9 GB)."""
        return Path(self.options.get("models_dir") or self.out / "models")


def hide_absent_packages(out: Path) -> None:
    """Make ABSENT_ON_DEVICE unimportable here and in every process this one starts (the multi-process
    executor's stages): a sitecustomize.py on PYTHONPATH does the same in each at start-up."""
    for name in ABSENT_ON_DEVICE:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import fails; find_spec returns None
    site = out / "absent_packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {ABSENT_ON_DEVICE!r}:\n"
        "    sys.modules.setdefault(name, None)\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)  # a reader never sees half a file


def run_phase(ctx: Context) -> dict[str, Any]:
    module = importlib.import_module(f"ppserve.gpu_check.{PHASES[ctx.name]}")
    t0 = time.perf_counter()
    try:
        result: dict[str, Any] = module.run(ctx)
        result.setdefault("ok", True)
    except Exception as e:  # recorded, not raised: the JSON is the phase's whole answer
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    if "error" in result or result.get("not_run"):
        result["headline"] = result.get("error") or result["not_run"]
    else:
        try:  # a figure missing from a result must not lose the result
            result["headline"] = module.headline(result)
        except Exception as e:
            result["headline"] = f"(no headline: {type(e).__name__}: {e})"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ppserve.gpu_check.phase")
    p.add_argument("name", choices=sorted(PHASES))
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--options", default="{}", help="the runner's options, as JSON")
    args = p.parse_args(argv)
    ctx = Context(args.name, args.device, Path(args.out), json.loads(args.options))
    ctx.out.mkdir(parents=True, exist_ok=True)
    hide_absent_packages(ctx.out)
    result = run_phase(ctx)
    write_json(ctx.out / f"{ctx.name}.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, default=str)[:4000], flush=True)
    return 1 if phase_status(result) == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
