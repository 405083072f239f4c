"""`--launch-workers N`: start N local workers (python -m worker) as child processes.

The router owns their lifetime: they get free loopback ports, and are terminated (then killed
after a grace period) when the router exits; on Linux they get SIGTERM even when the router is
killed (SIGKILL, the OOM killer), through the kernel's parent-death signal."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("radixgate.router.launcher")

CONFIG_ERROR = 2  # python -m worker's exit code for arguments or a model it cannot start with
_PR_SET_PDEATHSIG = 1  # prctl(2)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _dies_with(parent: int) -> Callable[[], None] | None:
    """For ``Popen(preexec_fn=)``: the child gets SIGTERM when the thread that started it ends with
    its process (started from the main thread, or the launcher's watch thread, which lives as long),
    whatever ends it; None where the kernel has no such signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    # NOTE: preexec_fn runs Python in the child of a process with threads (Python's docs warn of it):
    # kept to two system calls, through a function looked up here, before the fork; nothing imported
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # NOTE: the router died before the call: no signal will come
            os._exit(1)

    return child


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL whatever outlives ``grace_s``."""
    terminate_processes(processes)
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def terminate_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, without waiting."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()


def redis_server_command(port: int, *args: str) -> list[str]:
    """argv of a throwaway ``redis-server`` on a loopback port, without persistence (load tests,
    benchmarks, tests). ``args``: extra server flags."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH")
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args]


def wait_for_port(proc: subprocess.Popen, port: int, timeout_s: float = 10.0) -> None:
    """Return once ``proc`` accepts connections on a loopback ``port``; stop it and raise if it
    exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.02)  # NOTE: polling with a deadline, not a blind wait
    stop_processes([proc])
    raise RuntimeError(f"{proc.args[0]} did not listen on port {port}")


def redis_server(port: int, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """Start ``redis_server_command(port, *args)``; returns once it accepts connections."""
    proc = subprocess.Popen(redis_server_command(port, *args), stdout=stdout, stderr=subprocess.STDOUT)
    wait_for_port(proc, port)
    return proc


# the worker settings the launcher makes itself: a --worker-arg naming one is refused (dest: why)
LAUNCHER_SETS = {
    "model": "--model (the router's --model)",
    "host": "--host (127.0.0.1)",
    "port": "--port (a free port the router polls)",
    "advertise_url": "--advertise-url (its loopback URL)",
    "api_key": "--api-key (the router's --worker-api-key)",
    "redis_url": "--redis-url (the router's --redis-url)",
}


def check_worker_args(model: str, args: list[str]) -> None:
    """ValueError where this Python lacks the worker's dependencies or for ``--worker-arg`` flags the
    workers would refuse (they would exit at once, and the router serve 503 for good), or for flags that
    set what the launcher sets: a port the router never polls, a key it does not hold (every request
    401, and the key in the "starting worker" log line)."""
    # NOTE: imported here: the router imports no worker module
    from worker.config import INSTALL_HINT, build_parser, missing_modules, parse_args

    missing = missing_modules()
    if missing:  # NOTE: a router-only install (pip install radixgate)
        raise ValueError(
            f"--launch-workers: the workers need {', '.join(missing)}, not installed: {INSTALL_HINT}"
        )

    given = build_parser()
    for action in given._actions:  # NOTE: no defaults: what the flags name is all it returns
        action.default = argparse.SUPPRESS
    try:
        named = vars(given.parse_known_args(args)[0])  # NOTE: the flags spelled out, abbreviations too
        parse_args(["--model", model, *args])  # every flag and value, as a launched worker reads them
    except SystemExit:  # argparse told what (on stderr)
        raise ValueError("--worker-arg: the workers refuse these flags (see above)") from None
    taken = [why for dest, why in LAUNCHER_SETS.items() if dest in named]
    if taken:
        raise ValueError(f"--worker-arg sets what the launcher sets for its workers: {', '.join(taken)}")


class WorkerLauncher:
    """Starts the workers and keeps them running: a worker that exits (a crash, an OOM kill) is
    started again on its own port, after a pause that grows while it keeps failing soon after its
    start (``restart_delays_s``); the router sees it healthy again, with a new epoch. One that
    refused its arguments or model (exit code 2) is left stopped: starting it again cannot help."""

    restart_delays_s = (1.0, 2.0, 5.0, 10.0, 30.0)
    stable_after_s = 60.0  # a worker that ran this long before it exited is restarted at the first delay

    def __init__(
        self, count: int, model: str, extra_args: list[str], redis_url: str | None, api_key: str | None = None
    ) -> None:
        self.count = count
        self.model = model
        self.extra_args = extra_args
        # NOTE: both reach the workers in their environment, not argv: a key, or a password in the URL,
        # would show in process listings and in the "starting worker" log line
        self.api_key = api_key  # the workers' --api-key
        self.redis_url = redis_url
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self._commands: list[list[str]] = []
        self._started_at: list[float] = []
        self._failures: list[int] = []  # exits in a row, each but the first soon after its start
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # the router is ending: no restarts (the watch thread lives on: the workers it started get the
        # parent-death signal when it ends)
        self._no_restarts = threading.Event()

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
            log.info("starting worker: %s", " ".join(cmd))
            self._commands.append(cmd)
            self._started_at.append(time.monotonic())
            self._failures.append(0)
            self.processes.append(self._spawn(cmd))
            self.urls.append(url)
        atexit.register(self.stop)
        threading.Thread(target=self._watch, name="worker-launcher", daemon=True).start()
        return self.urls

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        hidden = {"RADIXGATE_WORKER_API_KEY": self.api_key, "RADIXGATE_WORKER_REDIS_URL": self.redis_url}
        given = {name: value for name, value in hidden.items() if value}
        env = {**os.environ, **given} if given else None
        # NOTE: a process group of its own: a terminal's Ctrl-C reaches the router alone, which drains
        # (the workers serve the requests in flight) and then stops them; the router's death ends them
        return subprocess.Popen(cmd, env=env, preexec_fn=_dies_with(os.getpid()), process_group=0)

    def _watch(self, poll_s: float = 0.5) -> None:
        restart_at: dict[int, float] = {}  # worker index -> when to start it again
        given_up: set[int] = set()
        while not self._stopping.wait(poll_s):
            now = time.monotonic()
            for i, proc in enumerate(self.processes):
                code = proc.poll()
                if code is None or self._stopping.is_set() or self._no_restarts.is_set():  # NOTE: no restart
                    continue
                if code == CONFIG_ERROR:
                    if i not in given_up:
                        given_up.add(i)
                        log.error("worker %s exited with code %s: its arguments or model cannot start it; "
                                  "not starting it again", self.urls[i], code)  # fmt: skip
                    continue
                if i not in restart_at:
                    ran = now - self._started_at[i]
                    self._failures[i] = 1 if ran >= self.stable_after_s else self._failures[i] + 1
                    delay = self.restart_delays_s[min(self._failures[i], len(self.restart_delays_s)) - 1]
                    restart_at[i] = now + delay
                    log.warning("worker %s exited with code %s after %.0f s; starting it again in %.0f s",
                                self.urls[i], code, ran, delay)  # fmt: skip
                elif now >= restart_at[i]:
                    with self._lock:
                        if self._stopping.is_set() or self._no_restarts.is_set():
                            continue
                        try:
                            self.processes[i] = self._spawn(self._commands[i])
                        except OSError as exc:  # NOTE: no fork now (EAGAIN, ENOMEM): try again later; this
                            # thread must live on, the parent-death signal of the workers it started is its end
                            restart_at[i] = now + self.restart_delays_s[-1]
                            log.error("starting worker %s again failed: %r; trying again in %.0f s",
                                      self.urls[i], exc, self.restart_delays_s[-1])  # fmt: skip
                            continue
                    del restart_at[i]
                    self._started_at[i] = now

    def shutting_down(self) -> None:
        """The router is ending: a worker that exits now is not started again (a control group's
        SIGTERM reaches the workers too: each drains and ends, and a restart would only be killed)."""
        self._no_restarts.set()

    def terminate(self) -> None:
        """SIGTERM every worker now, not waiting (the router is ending at once: they end by themselves)."""
        with self._lock:
            self._stopping.set()
        terminate_processes(self.processes)

    def stop(self, grace_s: float = 10.0) -> None:
        with self._lock:
            self._stopping.set()
        stop_processes(self.processes, grace_s)
        self.processes.clear()
