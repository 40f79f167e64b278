"""The installed wheel works away from the checkout: its data files (configs, the simulator's hardware
and model tables, kernel sources, the proto) are package data, and nothing reaches back into the repo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, installed (without dependencies: this venv has them) into a
    directory of its own; returns that directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(REPO)], check=True, cwd=tmp)
    wheels = list((tmp / "dist").glob("ppserve-*.whl"))
    assert len(wheels) == 1, wheels
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(wheels[0])], check=True, cwd=tmp)
    return site


def _run(site: Path, cwd: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of the editable install of this checkout
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{args}: rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_the_wheel_ships_its_data(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, tmp_path, "-c",
               "import ppserve, ppserve.sim.cost_model as c; print(ppserve.__file__); print(c.CONFIG_DIR)")
    pkg, config_dir = out.split()
    assert pkg.startswith(str(installed)), pkg  # the wheel's copy, not the checkout
    assert (Path(config_dir) / "hardware" / "a100.yaml").is_file()
    assert (Path(config_dir) / "default.yaml").is_file()
    assert (installed / "ppserve" / "model" / "csrc" / "bf16.h").is_file()


def test_simulate_runs_from_an_installed_wheel(installed: Path, tmp_path: Path) -> None:
    assert "--hardware" in _run(installed, tmp_path, "-m", "ppserve.cli", "simulate", "--hardware", "a100",
                                "--help")
    trace = tmp_path / "trace.csv"
    rows = [f"{i * 0.05:.2f},{200 + 37 * i},{20 + i % 7}" for i in range(40)]
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "\n".join(rows) + "\n")
    out = _run(installed, tmp_path, "-m", "ppserve.cli", "simulate", "--hardware", "a100",
               "--model", "llama3-8b", "--pp", "2", "--workload", str(trace),
               "--json", str(tmp_path / "sim.json"))
    assert (tmp_path / "sim.json").is_file(), out
    assert "bubble" in out.lower()
