"""Shared fixtures: real processes on loopback, stopped by PID at teardown."""

from __future__ import annotations

import pytest

from tests.support import Proc, start_module


class Launcher:
    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.procs: list[Proc] = []

    def echo_backend(self, *args: str, port: int | None = None) -> Proc:
        proc = start_module("loadtest.echo_backend", list(args), self.tmp_dir, port=port)
        self.procs.append(proc)
        return proc

    def router(self, workers: list[str], *args: str, ready_path: str = "/health") -> Proc:
        worker_args = ["--workers", ",".join(workers)] if workers else []
        proc = start_module("router", [*worker_args, *args], self.tmp_dir, ready_path=ready_path)
        self.procs.append(proc)
        return proc

    def module(self, module: str, *args: str, port: int | None = None, timeout: float = 60.0) -> Proc:
        proc = start_module(module, list(args), self.tmp_dir, port=port, timeout=timeout)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


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
