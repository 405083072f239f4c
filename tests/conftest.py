"""Shared fixtures: real processes on loopback, stopped by PID at teardown; and the test tiers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support import Proc, free_port, start_module, start_redis

# NOTE: a suite started as a non-interactive shell's background job (`bash scripts/test &`) inherits SIGINT
# ignored, and so would every process it starts (an ignored signal stays ignored across exec): the servers
# under test take SIGINT as a terminal's foreground job has it
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked slow (the full tier; RADIXGATE_FULL_TESTS=1 does the same)")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default tier leaves out the tests marked slow (the rest of a cross product whose every value
    the default tier runs, the whole-architecture compile sweeps: README; docs/kernels.md, Tests), but
    not a test named on the command line (``file::test`` or ``file::test[case]``)."""
    if config.getoption("--full") or os.environ.get("RADIXGATE_FULL_TESTS") == "1":
        return
    named = set()
    for arg in config.args:
        path, sep, name = arg.partition("::")
        if sep:
            with contextlib.suppress(ValueError):  # a path outside the checkout names nothing here
                named.add(f"{Path(os.path.abspath(path)).relative_to(config.rootpath).as_posix()}::{name}")
    kept, slow = [], []
    for item in items:
        named_here = item.nodeid in named or item.nodeid.partition("[")[0] in named
        (slow if item.get_closest_marker("slow") and not named_here else kept).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept


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
