"""Test support: start real processes on loopback ports and wait for them without sleeping blind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from router.launcher import free_port, redis_server, stop_processes

REDIS = shutil.which("redis-server")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(
    predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Proc:
    """A child process serving HTTP at ``url``."""

    proc: subprocess.Popen
    url: str
    log_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test froze it
        stop_processes([self.proc], grace_s=15)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def start_module(
    module: str,
    args: list[str],
    tmp_dir: str,
    port: int | None = None,
    ready_path: str = "/health",
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Proc:
    """Run ``python -m module --port P args`` and wait until GET ready_path answers 200."""
    port = port or free_port()
    log_path = os.path.join(tmp_dir, f"{module.replace('.', '_')}-{port}.log")
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=full_env,
        )
    handle = Proc(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until(
            lambda: proc.poll() is not None or http_ok(handle.url + ready_path),
            timeout,
            what=f"{module} on {port}",
        )
    except AssertionError:
        handle.stop()
        raise AssertionError(f"{module} did not become ready:\n{handle.log()[-3000:]}") from None
    if proc.poll() is not None:
        raise AssertionError(f"{module} exited with {proc.returncode}:\n{handle.log()[-3000:]}")
    return handle


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway redis-server on a loopback port (no persistence); returns once it accepts connections."""
    assert REDIS is not None, "redis-server not installed"
    return redis_server(port)
