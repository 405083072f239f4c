"""Shared fixtures: real processes on loopback, stopped by PID at teardown."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import Proc, free_port, start_module, start_redis


class Launcher:
    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.procs: list[Proc] = []
        self.servers: list[subprocess.Popen] = []

    def echo_backend(self, *args: str, port: int | None = None) -> Proc:
        proc = start_module("loadtest.echo_backend", list(args), self.tmp_dir, port=port)
        self.procs.append(proc)
        return proc

    def router(
        self, workers: list[str], *args: str, ready_path: str = "/health", env: dict[str, str] | None = None
    ) -> Proc:
        worker_args = ["--workers", ",".join(workers)] if workers else []
        proc = start_module("router", [*worker_args, *args], self.tmp_dir, ready_path=ready_path, env=env)
        self.procs.append(proc)
        return proc

    def module(self, module: str, *args: str, port: int | None = None, timeout: float = 60.0) -> Proc:
        proc = start_module(module, list(args), self.tmp_dir, port=port, timeout=timeout)
        self.procs.append(proc)
        return proc

    def sim_worker(self, *args: str) -> Proc:
        """A worker on the cost-model engine (sim-8b), advertising its own loopback URL."""
        port = free_port()
        return self.module("worker", "--engine", "sim", "--model", "sim-8b", "--advertise-url",
                           f"http://127.0.0.1:{port}", *args, port=port)  # fmt: skip

    def redis(self) -> str:
        """Start a redis-server on a free loopback port; returns its URL."""
        port = free_port()
        self.servers.append(start_redis(port))
        return f"redis://127.0.0.1:{port}/0"

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        for server in self.servers:
            server.terminate()
            server.wait(timeout=10)
        self.servers.clear()


@pytest.fixture
def launch(tmp_path):
    launcher = Launcher(str(tmp_path))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def launch_module(tmp_path_factory):
    launcher = Launcher(str(tmp_path_factory.mktemp("procs")))
    yield launcher
    launcher.stop_all()
