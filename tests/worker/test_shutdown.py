"""A worker stopped by SIGTERM (python -m worker, a real process): requests still in flight when its
shutdown timeout runs out are answered with a 503, in a stream an error event and [DONE], rather than
cut, and the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.support import start_module, wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True}  # tens of seconds on a CPU: far past the timeout below


def test_requests_in_flight_at_the_end_of_the_shutdown_timeout_get_a_503_not_a_cut_connection(tmp_path):
    worker = start_module("worker", ["--shutdown-timeout-s", "1.5", "--warmup-tokens", "0"], str(tmp_path))
    got: dict[str, object] = {"lines": []}
    streaming = threading.Event()

    def stream() -> None:
        body = {"prompt": "once upon a time", "stream": True, **LONG}
        with httpx.stream("POST", worker.url + "/v1/completions", json=body, timeout=60) as r:
            got["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    got["lines"].append(line)
                    streaming.set()

    def whole() -> None:
        try:
            r = httpx.post(
                worker.url + "/v1/completions", json={"prompt": "a long answer", **LONG}, timeout=60
            )
            got["whole"] = (r.status_code, r.json() if r.status_code != 500 else r.text)
        except httpx.HTTPError as exc:  # a cut connection
            got["whole"] = (None, repr(exc))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        assert streaming.wait(30), worker.log()[-2000:]
        wait_until(lambda: _running(worker.url) == 2, 10, what="both requests running")
        worker.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        for t in threads:
            t.join(30)
        # NOTE: uvicorn raises the signal it caught again once it has shut down
        assert worker.proc.wait(30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in worker.log()
        # NOTE: uvicorn cancels what is left 1.5 s after SIGTERM; the answers come 1 s before that
        assert time.monotonic() - stopped < 15
    finally:
        worker.stop()
    status, answer = got["whole"]
    assert status == 503 and answer["error"]["code"] == "shutting_down", (status, answer)
    lines = got["lines"]
    assert got["stream_status"] == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    tokens = [json.loads(x.removeprefix("data: ")) for x in lines[:-2]]
    assert tokens and all(t["choices"][0]["finish_reason"] is None for t in tokens)  # cut short, said so


def _running(url: str) -> int:
    try:
        return int(httpx.get(url + "/health", timeout=1).json().get("running", 0))
    except (httpx.HTTPError, ValueError):
        return -1
