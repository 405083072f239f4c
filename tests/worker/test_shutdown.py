"""A worker stopped by SIGTERM (python -m worker, a real process): requests still in flight when its
shutdown timeout runs out are answered with a 503, in a stream an error event and [DONE], rather than
cut, and the process exits; a worker whose engine thread dies exits by itself, with code 1."""

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

    def responses(stream: bool) -> None:  # the Responses API's answer and its stream's response.failed
        body = {"input": "a long answer", "max_output_tokens": 3000, "ignore_eos": True, "stream": stream}
        try:
            r = httpx.post(worker.url + "/v1/responses", json=body, timeout=60)
            got[f"responses_{stream}"] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            got[f"responses_{stream}"] = (None, repr(exc))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    threads += [threading.Thread(target=responses, args=(s,)) for s in (False, True)]
    try:
        for t in threads:
            t.start()
        assert streaming.wait(30), worker.log()[-2000:]
        wait_until(lambda: _running(worker.url) == 4, 10, what="all four requests running")
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
    status, text = got["responses_False"]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", (status, text)
    status, text = got["responses_True"]
    events = [json.loads(x.removeprefix("data: ")) for x in text.splitlines() if x.startswith("data: ")]
    assert status == 200 and events[-1]["type"] == "response.failed", (status, text[-500:])
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["type"] == "shutting_down" and "shutting down" in failed["error"]["message"]


def _running(url: str) -> int:
    try:
        return int(httpx.get(url + "/health", timeout=1).json().get("running", 0))
    except (httpx.HTTPError, ValueError):
        return -1


# A real worker process whose engine thread dies of a fault (injected into the engine's scheduler
# once it is ready, as a bug there would): the request in flight gets its error, and the process exits.
_DIES = """
import sys, threading
import worker.__main__ as entry

build = entry.build

def build_and_break(cfg):
    app = build(cfg)
    engine = app.state.api.engine

    def fault():
        engine.ready.wait(60)
        schedule = engine.scheduler.schedule

        def schedule_once_more():  # the request below is admitted, then the next step fails
            engine.scheduler.schedule = broken
            return schedule()

        def broken():
            raise RuntimeError("injected scheduler fault")

        engine.scheduler.schedule = schedule_once_more

    threading.Thread(target=fault, daemon=True).start()
    return app

entry.build = build_and_break
sys.exit(entry.main(sys.argv[1:]))
"""


def test_a_worker_whose_engine_dies_exits_so_it_can_be_started_again(tmp_path):
    import subprocess
    import sys

    from tests.support import free_port

    port = free_port()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _DIES, "--engine", "sim", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _running(url) == 0, 60, what="the worker up")
        answer = httpx.post(
            url + "/v1/completions", json={"prompt": "anyone?", "max_tokens": 200}, timeout=60
        )
        assert answer.status_code == 503 and "injected scheduler fault" in answer.text  # failed, not hung
        assert proc.wait(30) == 1  # NOTE: not 0: a supervisor sees a failure
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "engine thread died" in text and "the engine thread died: shutting the worker down" in text


def test_ctrl_c_ends_the_worker_quietly_with_the_status_of_a_ctrl_c(tmp_path):
    """SIGINT (a terminal's Ctrl-C) drains as SIGTERM does and ends the process by the signal (130 in a
    shell), with no KeyboardInterrupt traceback in its log."""
    import subprocess
    import sys

    from tests.support import ROOT, free_port

    port = free_port()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--engine", "sim", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
    try:
        wait_until(lambda: _running(f"http://127.0.0.1:{port}") == 0, 60, what="the worker up")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Finished server process" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]
