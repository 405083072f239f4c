"""A router stopped by SIGTERM with --shutdown-delay-s (python -m router, a real process, in front of the
echo backend): it first leaves rotation (/ready 503) while still serving, then shuts down with the
requests in flight finished."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.support import wait_until

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
