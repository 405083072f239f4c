"""Test support: start real processes on loopback ports and wait for them without sleeping blind."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from router.launcher import redis_server, stop_processes

REDIS = shutil.which("redis-server")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORTS_PER_PROCESS = 1000
# NOTE: the suite runs in several processes (pytest-xdist), each starting servers of its own: torch's default of
# a compute thread a core oversubscribes the cores (worker/test_speculative, test_bench and test_model in two
# processes on 2 cores: 149 -> 90 s with one thread each). Set before torch is imported in this process or in a
# server it starts; OMP_NUM_THREADS chooses otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the environment the fork server imports under: this process's as the session starts, not as the test that
# happens to start the first server has changed it
_SESSION_ENV = {**os.environ, "PYTHONPATH": ROOT}


def _port_block() -> range:
    """This test process's loopback ports: a block just below the kernel's ephemeral range, one
    block per pytest-xdist worker. A port the kernel hands out (bind to port 0) lies in that range,
    where any outgoing connection can take it between the pick and the server's own bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:
        ephemeral_low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    top = ephemeral_low - PORTS_PER_PROCESS * int(worker.removeprefix("gw"))
    if top - PORTS_PER_PROCESS < 1024:
        raise RuntimeError(f"no room for {worker}'s ports below the ephemeral range ({ephemeral_low})")
    return range(top - PORTS_PER_PROCESS, top)


_next_ports = itertools.cycle(_port_block())


def free_port() -> int:
    """A loopback port nothing listens on, that no other test process is handed: the next one of
    this process's block that binds (with SO_REUSEADDR, as the servers bind)."""
    for _ in range(PORTS_PER_PROCESS):
        port = next(_next_ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("every port of this test process's block is taken")


SLOW = pytest.mark.slow  # the full tier only (pytest --full; scripts/test --full)


def each_value_once(*axes: Sequence[Any]) -> list[Any]:
    """Parametrize values for the cross product of ``axes``; an axis's value is one parameter, or a
    tuple of several (a shape: spliced into the case, counted as one value). Every value of every axis
    runs in the default tier, in as few cases as a greedy cover finds: again and again the case that
    brings the most values not run yet, of those the one that brings the most pairs of values not run
    together yet, then the one whose values ran least (max(n1, n2, ...) of n1 x n2 x ... cases). The
    other cases are marked slow (the full tier). Values are told apart by repr; an id joins their str."""
    cases = list(itertools.product(*axes))
    keys = [[(i, repr(value)) for i, value in enumerate(case)] for case in cases]
    runs: dict[tuple[int, str], int] = {}  # how many default cases run each value
    pairs: set[tuple] = set()  # the pairs of values some default case runs together
    default: set[int] = set()

    def score(i: int) -> tuple:
        k = keys[i]
        new_pairs = set(itertools.combinations(k, 2)) - pairs
        return (sum(v not in runs for v in k), len(new_pairs), -sum(runs.get(v, 0) for v in k), -i)

    while cases:
        best = max(range(len(cases)), key=score)
        if score(best)[0] == 0:  # every value runs
            break
        default.add(best)
        pairs.update(itertools.combinations(keys[best], 2))
        for v in keys[best]:
            runs[v] = runs.get(v, 0) + 1
    params = []
    for i, case in enumerate(cases):
        values = [x for value in case for x in (value if isinstance(value, tuple) else (value,))]
        marks = () if i in default else SLOW
        params.append(pytest.param(*values, marks=marks, id="-".join(map(_label, case))))
    return params


def _label(value: Any) -> str:
    """A case's id part: a tuple's values joined by "/", a dtype without its module."""
    if isinstance(value, tuple):
        return "/".join(map(_label, value))
    return str(value).removeprefix("torch.")


def wait_until(
    predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def serve_in_thread(app: object, what: str) -> tuple[str, object]:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread of this process;
    returns (its URL, the uvicorn server: set ``should_exit`` to stop it)."""
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    wait_until(lambda: server.started, 10, what=what)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Proc:
    """A child process serving HTTP at ``url``."""

    proc: subprocess.Popen | ForkedProcess
    url: str
    log_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test froze it
        stop_processes([self.proc], grace_s=15)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def access_lines(self) -> list[dict]:
        """The JSON records of a router's ``--access-log``, in the order written."""
        marker = "radixgate.access: "
        return [orjson.loads(line.split(marker, 1)[1]) for line in self.log().splitlines() if marker in line]


class ForkedProcess:
    """A child of the fork server (tests.forkserver), with the part of ``subprocess.Popen``'s API the tests
    use. Its exit status comes from the file the fork server writes as it reaps it."""

    def __init__(self, pid: int, args: list[str], status_path: str) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status_path = status_path

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with open(self._status_path) as f:
                    self.returncode = int(f.read())
            except FileNotFoundError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This test process's tests.forkserver, started with ``env``: it starts the modules a test runs under
    that same environment but for the variables pytest changes from test to test (any other runs a plain
    subprocess: modules read some settings as they are imported, before the fork)."""

    # NOTE: variables that may differ from the server's without a module seeing other settings: pytest
    # changes PYTEST_CURRENT_TEST from test to test, and importing torch._dynamo (transformers does) sets
    # TORCHINDUCTOR_CACHE_DIR to the default a fresh interpreter computes the same way. The child is given
    # the test's environment whole either way.
    NEUTRAL = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")

    def __init__(self, env: dict[str, str]) -> None:
        import tempfile

        self.env = env
        self._status_dir = tempfile.mkdtemp(prefix="radixgate-forks-")
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", self._status_dir],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env)  # fmt: skip
        self._lock = threading.Lock()
        if self._proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"tests.forkserver did not start (exit status {self._proc.wait()})")

    def differ(self, env: dict[str, str]) -> set[str]:
        """The variables of ``env`` a module would see set otherwise forked from this server (none:
        it sees the settings it would see started on its own)."""
        return {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)} - set(self.NEUTRAL)

    def start(self, module: str, args: list[str], log_path: str, env: dict[str, str]) -> ForkedProcess:
        with self._lock:
            request = {"module": module, "args": args, "log": log_path, "env": env}
            self._proc.stdin.write(orjson.dumps(request) + b"\n")
            self._proc.stdin.flush()
            pid = int(self._proc.stdout.readline())
        argv = [sys.executable, "-m", module, *args]
        return ForkedProcess(pid, argv, os.path.join(self._status_dir, str(pid)))

    def close(self) -> None:
        """Ends the fork server (not the children still running) and removes its status files."""
        self._proc.stdin.close()
        self._proc.wait(timeout=10)
        shutil.rmtree(self._status_dir, ignore_errors=True)


_fork_server: ForkServer | None = None
_fork_server_lock = threading.Lock()


def fork_server_for(
    env: dict[str, str], module: str = "a module", asked: Sequence[str] = ()
) -> ForkServer | None:
    """The fork server to start ``module`` under ``env`` with, or None for a plain subprocess (another
    environment, or RADIXGATE_TEST_FORK=0). Warns when variables other than ``asked`` make the difference."""
    global _fork_server
    if os.environ.get("RADIXGATE_TEST_FORK", "1") == "0":
        return None
    with _fork_server_lock:
        if _fork_server is None:
            _fork_server = ForkServer(_SESSION_ENV)
            atexit.register(_fork_server.close)
    changed = _fork_server.differ(env)
    if unasked := changed - set(asked):
        # NOTE: a test's monkeypatch, or a library that wrote os.environ (it then costs every later start of
        # this process a fresh interpreter: add it to NEUTRAL if harmless)
        warnings.warn(f"{module} starts in a fresh interpreter: os.environ differs from the session's in "
                      f"{sorted(unasked)}", stacklevel=3)  # fmt: skip
    return None if changed else _fork_server


def start_module(
    module: str,
    args: list[str],
    tmp_dir: str,
    port: int | None = None,
    ready_path: str = "/health",
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Proc:
    """Run ``python -m module --port P args`` (forked from the fork server where the environment allows)
    and wait until GET ready_path answers 200."""
    port = port or free_port()
    log_path = os.path.join(tmp_dir, f"{module.replace('.', '_')}-{port}.log")
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    argv = ["--port", str(port), *args]
    with open(log_path, "wb") as log:
        server = fork_server_for(full_env, module, asked=list(env or ()))
        if server is not None:
            proc = server.start(module, argv, log_path, full_env)
        else:
            proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=ROOT, env=full_env)  # fmt: skip
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


def children(pid: int) -> list[int]:
    """PIDs of the live processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway redis-server on a loopback port (no persistence); returns once it accepts connections."""
    assert REDIS is not None, "redis-server not installed"
    return redis_server(port)


class SilencingProxy:
    """A TCP proxy from a loopback port to ``target_port``, served in a daemon thread. ``silence()``:
    the connections open then pass no more bytes either way and stay open, as a connection a NAT or
    a firewall forgot does (neither end sees it end); connections made later pass as before."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._open: list[list] = []  # [silenced, its two writers] per connection: kept open while silent
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(asyncio.start_server(self._relay, sock=sock), self._loop).result(10)

    def silence(self) -> None:
        async def now() -> None:
            for connection in self._open:
                connection[0] = True

        asyncio.run_coroutine_threadsafe(now(), self._loop).result(10)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self._target)
        connection = [False, client_writer, upstream_writer]
        self._open.append(connection)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                if not connection[0]:
                    writer.write(data)
                    await writer.drain()
            if not connection[0]:
                writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer),
                             return_exceptions=True)  # fmt: skip
