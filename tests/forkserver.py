"""The test suite's process starter: one process that has imported torch, the worker and the router forks
a child for each server a test starts (``python -m tests.forkserver STATUS_DIR``; tests.support talks to
it). A fresh interpreter spends ~3 s of CPU before a tiny worker is ready, 2 s of it importing torch;
a forked child is ready in ~0.5 s, a router in ~0.05 s instead of ~0.7.

Each child runs ``python -m MODULE ARGS`` as a fresh interpreter would: ``runpy`` with ``sys.argv`` set,
its stdin from /dev/null, its stdout and stderr into its log file, the interpreter's own exit (threads
joined, atexit handlers, a signal raised again by the module ends it by that signal). The preload only
imports: nothing runs a torch operation, starts a thread of its own or reads a test's settings before the
fork. A start whose environment differs from the one this process started with (beyond pytest's
PYTEST_CURRENT_TEST) runs a plain subprocess instead (tests.support decides), since modules read some
settings as they are imported.

Protocol, one JSON line each way: a request ``{"module", "args", "log", "env"}`` on stdin is answered with the
child's pid on stdout; when a child exits, its status (``subprocess.Popen.returncode``'s convention:
negative for a signal) is written to ``STATUS_DIR/<pid>``. End of stdin ends this process, not its
children."""

from __future__ import annotations

import os
import runpy
import select
import sys

import orjson

# the imports of ``python -m worker`` (tiny model on the CPU), ``python -m router`` and the echo backend;
# never a module that is itself run as __main__ (runpy would run it a second time)
PRELOAD = (
    "torch",
    "worker.assembly",
    "worker.model",
    "worker.server",
    "worker.config",
    "router.app",
    "router.config",
    "router.launcher",
    "router.discovery",
    "uvicorn",
)


def _reap(status_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        path = os.path.join(status_dir, str(pid))
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)


def _become(module: str, args: list[str], log: str, env: dict[str, str]) -> None:
    """In the child: the process ``python -m module args`` under ``env`` with its output to ``log``;
    returns when the module's code returns (the interpreter then exits as it would have)."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    status_dir = sys.argv[1]
    for name in PRELOAD:
        __import__(name)
    import torch

    if torch.cuda.is_initialized():  # NOTE: a child of a process that holds CUDA cannot use it
        raise RuntimeError(f"importing {PRELOAD} initialized CUDA: the children could not use it")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    pending = b""
    while True:
        _reap(status_dir)
        readable, _, _ = select.select([0], [], [], 0.02)
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = orjson.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(request["module"], request["args"], request["log"], request["env"])
                return
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
