"""A real `ppserve serve` subprocess for the end-to-end tests, and the fixtures' ways to start and reach
it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ppserve.engine.stats import EngineStats
from ppserve.server.client import PPServeClient

GRACE_S = 1.0  # server.grace_seconds: how long SIGTERM lets running streams go on (test_server.py)
STARTUP_TIMEOUT_S = 240.0


class ServerProcess:
    """A `ppserve serve` subprocess; stdout is drained by a thread so the pipe can never fill up."""

    def __init__(self, log_path: Path, *extra: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "ppserve.cli",
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--set",
            "parallel.pipeline_parallel_size=2",
            "--set",
            f"server.grace_seconds={GRACE_S}",
            "--set",
            "model.dtype=float32",  # exactness against transformers is checked in float32
            *extra,
        ]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.address: str | None = None
        self.http_url: str | None = None  # the OpenAI-compatible API's base URL (ends in /v1)
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            h = re.search(r"ppserve OpenAI API on (\S+)", line)
            if h:
                self.http_url = h.group(1)
            m = re.search(r"ppserve serving on (\S+:\d+)", line)
            if m:
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()  # EOF: the process died

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        if self.address is None:
            self.stop()
            log = Path(self.log.name).read_text()[-4000:]
            raise RuntimeError(
                f"server did not come up; stdout={''.join(self.lines)[-2000:]}\nstderr tail:\n{log}"
            )
        return self.address

    def stop(self) -> None:
        if self.proc.poll() is None:
            # The whole session: the server and anything it spawned (its embedded Ray).
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


def set_args(*pairs: str) -> list[str]:
    """The `--set key=value` arguments of `ppserve serve` for each "key=value"."""
    return [arg for pair in pairs for arg in ("--set", pair)]


@contextmanager
def running_server(log_dir: Path, *extra: str) -> Iterator[ServerProcess]:
    """A started and ready server (its log in log_dir), killed with its whole session on the way out."""
    proc = ServerProcess(log_dir / "server.log", *extra)
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


@contextmanager
def ready_client(server: ServerProcess, **kwargs: Any) -> Iterator[PPServeClient]:
    """A gRPC client of `server` once its health check answers SERVING."""
    with PPServeClient(server.address or "", **kwargs) as c:
        c.wait_ready(30)
        yield c


def wait_idle(client: PPServeClient, timeout: float = 30.0) -> EngineStats:
    """GetStats once nothing runs, waits or holds a KV block (the server's stats after every request ends)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.kv_blocks_used == 0 and s.running + s.waiting == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle: {s}")
        time.sleep(0.2)


def metric_samples(m: Any) -> dict[str, float]:
    """A ServerMetrics' exposition as {"name{label=value,...}": value}, the model_name label left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
