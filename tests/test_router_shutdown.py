"""A router stopped by SIGTERM with --shutdown-delay-s (python -m router, a real process, in front of the
echo backend): it first leaves rotation (/ready 503) while still serving, then shuts down with the
requests in flight finished."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import ROOT, children, free_port, wait_until

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello"}]}


def test_sigterm_takes_the_router_out_of_rotation_before_it_stops(launch):
    backend = launch.echo_backend("--decode-ms-per-token", "50")
    router = launch.router([backend.url], "--shutdown-delay-s", "3", ready_path="/ready")
    lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:  # 100 tokens x 50 ms: runs past the delay
        body = {**CHAT, "max_tokens": 100, "stream": True}
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(10)
    router.proc.send_signal(signal.SIGTERM)
    ready = httpx.get(router.url + "/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200  # alive: not restarted
    answer = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=10)
    assert answer.status_code == 200  # still served while load balancers catch up
    wait_until(lambda: router.proc.poll() is not None, 30, what="the router to exit")
    thread.join(10)
    assert lines[-1] == "data: [DONE]" and len(lines) > 100  # the stream in flight finished
    assert router.proc.returncode in (0, -signal.SIGTERM)  # uvicorn raises the signal again at exit
    assert "SIGTERM: /ready answers 503; shutting down in 3.0 s" in router.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_the_router_at_once(launch, sig):
    """Either signal twice: the router ends without the notice's delay or the requests in flight
    (uvicorn alone forces a shutdown on a second SIGINT only)."""
    backend = launch.echo_backend("--decode-ms-per-token", "50")
    router = launch.router([backend.url], "--shutdown-delay-s", "60", ready_path="/ready")
    body = {**CHAT, "max_tokens": 2000, "stream": True}  # 100 s of tokens
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        router.proc.send_signal(sig)
        wait_until(
            lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 503, 10, what="the notice"
        )
        router.proc.send_signal(sig)
        wait_until(lambda: router.proc.poll() is not None, 20, what="the router to exit")
    assert router.proc.returncode == -sig  # NOTE: uvicorn raises the signal again as it ends


@contextlib.contextmanager
def launched_router(tmp_path, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m router --launch-workers 1 --worker-arg=--engine=sim ARGS`` in a session of its own,
    as a terminal's foreground job (a signal to its group is a Ctrl-C); yields (process, URL) once its
    worker is healthy, and kills what is left at the end. Its log is tmp_path/router.log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "router.log", "wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "router", "--port", str(port), "--launch-workers", "1",
             "--worker-arg=--engine=sim", *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: healthy(url), 120, what="the router and its worker")
        yield router, url
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait(10)


def healthy(url: str) -> bool:
    """Is the router's only worker healthy (False while the router does not answer)?"""
    try:
        return bool(httpx.get(url + "/workers", timeout=2).json()["workers"][0]["healthy"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return False


def test_ctrl_c_drains_the_launched_workers_requests_as_sigterm_does(tmp_path):
    """`python -m router --launch-workers N` in a terminal: Ctrl-C (SIGINT to the whole foreground
    process group) reaches the router alone, which lets the stream in flight finish; the workers
    shared its group, got the SIGINT themselves and cut the stream (and were restarted mid-shutdown)."""
    with launched_router(tmp_path, "--worker-arg=--sim-decode-base-ms=30") as (router, url):
        lines: list[str] = []
        body = {"prompt": "hello", "max_tokens": 150, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 5:  # NOTE: once: a second signal ends the router at once
                    os.killpg(router.pid, signal.SIGINT)  # the terminal's Ctrl-C
        assert lines[-1] == "data: [DONE]" and len(lines) > 150, lines[-2:]
        assert router.wait(60) == -signal.SIGINT  # NOTE: 130 in a shell, as Ctrl-C ends a program
    log = (tmp_path / "router.log").read_text()
    assert "starting it again" not in log  # no worker died on the way
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-2000:]  # a quiet end


def test_a_signal_to_the_whole_group_stops_the_launched_workers_for_good(tmp_path):
    """systemd's default stop (SIGTERM to every process of the unit's control group) reaches the
    launched workers too: they end, and the router, draining, does not start them again (it did,
    a second after, to kill them moments later)."""
    with launched_router(tmp_path, "--shutdown-delay-s", "3") as (router, _):
        worker_pids = children(router.pid)
        assert len(worker_pids) == 1
        for pid in (router.pid, *worker_pids):  # NOTE: the group of each (the workers have their own)
            os.kill(pid, signal.SIGTERM)
        assert router.wait(60) in (0, -signal.SIGTERM)
    text = (tmp_path / "router.log").read_text()
    assert "exited with code" in text or "SIGTERM" in text
    assert "starting it again" not in text, text[-2000:]


def test_a_restarted_worker_serves_through_the_routers_drain(tmp_path):
    """A worker the launcher started again (after a crash) came from its watch thread, and the
    parent-death signal follows that thread: the router's first signal must not end the thread,
    or the restarted worker dies at once and the drain has no worker (503s)."""
    with launched_router(tmp_path, "--shutdown-delay-s", "4") as (router, url):
        (first,) = children(router.pid)
        os.kill(first, signal.SIGKILL)  # a crash: the launcher starts it again
        wait_until(lambda: first not in children(router.pid) and len(children(router.pid)) == 1
                   and healthy(url), 60, what="the worker started again")  # fmt: skip
        (second,) = children(router.pid)
        router.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # NOTE: into the drain (4 s): the restarted worker must still be there
        assert children(router.pid) == [second]
        body = {"prompt": "still served", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert router.wait(60) in (0, -signal.SIGTERM)


def test_launched_workers_get_the_redis_url_and_their_key_in_their_environment_not_argv(tmp_path):
    """A password in the Redis URL, and the key made for the workers, show in no process listing and
    no log line: they reach the workers through their environment."""
    secret_url = "redis://:s3cret-pw@127.0.0.1:1/0"  # nothing listens: the workers drop their events
    with launched_router(tmp_path, "--redis-url", secret_url) as (router, url):
        (worker,) = children(router.pid)
        with open(f"/proc/{worker}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{worker}/environ", "rb") as f:
            environ = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert environ[b"RADIXGATE_WORKER_REDIS_URL"] == secret_url.encode()
        key = environ[b"RADIXGATE_WORKER_API_KEY"]
        assert len(key) >= 32 and not any(b"s3cret" in a or key in a for a in argv), argv
        assert b"--kv-hints" not in argv  # keyed, the default: the router's hints only
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    log = (tmp_path / "router.log").read_bytes()
    assert b"starting worker" in log and b"s3cret" not in log and key not in log
