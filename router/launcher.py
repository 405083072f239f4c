"""`--launch-workers N`: start N local workers (python -m worker) as child processes.

The router owns their lifetime: they get free loopback ports, and are terminated (then killed
after a grace period) when the router exits, whatever way it exits."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys

log = logging.getLogger("radixgate.router.launcher")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL whatever outlives ``grace_s``."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerLauncher:
    def __init__(self, count: int, model: str, extra_args: list[str], redis_url: str | None) -> None:
        self.count = count
        self.model = model
        self.extra_args = extra_args
        self.redis_url = redis_url
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self) -> list[str]:
        for _ in range(self.count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "worker", "--model", self.model, "--host", "127.0.0.1"]
            cmd += ["--port", str(port), "--advertise-url", url]
            if not any(a.startswith("--cpu-threads") for a in self.extra_args):
                # CPU workers sharing one machine: split the cores instead of oversubscribing them
                cmd += ["--cpu-threads", str(max(1, (os.cpu_count() or 1) // self.count))]
            cmd += self.extra_args
            if self.redis_url:
                cmd += ["--redis-url", self.redis_url]
            log.info("starting worker: %s", " ".join(cmd))
            self.processes.append(subprocess.Popen(cmd))
            self.urls.append(url)
        atexit.register(self.stop)
        return self.urls

    def stop(self, grace_s: float = 10.0) -> None:
        stop_processes(self.processes, grace_s)
        self.processes.clear()
