"""The echo backend (loadtest/echo_backend.py) as a real process: a client that leaves during the
simulated prefill ends its request there, as a real server aborts it; its cached_tokens are what a
real worker would report."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support import wait_until


def _running(url: str) -> int:
    return httpx.get(url + "/health", timeout=5).json()["running"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_during_the_prefill_ends_its_request(launch, stream):
    echo = launch.echo_backend("--prefill-us-per-token", "1000000")  # 1 s a token
    body = {"model": "echo", "prompt": "ten tokens", "max_tokens": 2, "stream": stream}  # 10 s of prefill
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(echo.url + "/v1/completions", json=body, timeout=0.5)
    left = time.monotonic()
    wait_until(lambda: _running(echo.url) == 0, 5, what="the request ended when its client left")
    assert time.monotonic() - left < 5  # NOTE: not the 10 s the prefill would have taken
    short = {**body, "prompt": "ab"}  # 2 s of prefill, waited for: answered whole
    answer = httpx.post(echo.url + "/v1/completions", json=short, timeout=30)
    assert answer.status_code == 200 and _running(echo.url) == 0
    if stream:
        assert answer.text.endswith("data: [DONE]\n\n")
    else:
        assert answer.json()["choices"][0]["text"] == "xx"


def test_a_prompt_seen_before_still_computes_its_last_token(launch):
    """As a real worker: a prompt of whole cached blocks reports its last block uncached (the worker
    computes at least one token); one token more and every whole block is cached."""
    echo = launch.echo_backend()

    def cached(prompt: str) -> tuple[int, int]:
        body = {"model": "echo", "prompt": prompt, "max_tokens": 1}
        usage = httpx.post(echo.url + "/v1/completions", json=body, timeout=10).json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    assert cached("x" * 64) == (64, 0)  # 4 blocks of 16 byte tokens
    assert cached("x" * 64) == (64, 48)
    assert cached("x" * 65) == (65, 64)


@pytest.mark.parametrize("stream", [False, True])
def test_a_one_token_answer_takes_no_decode_step(launch, stream):
    """The prefill makes the first token, whole answers as streamed ones: max_tokens - 1 decode steps."""
    echo = launch.echo_backend("--decode-ms-per-token", "1000000")  # 1000 s a decode step
    body = {"model": "echo", "prompt": "one token", "max_tokens": 1, "stream": stream}
    answer = httpx.post(echo.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200 and '"text":"x"' in answer.text


def test_the_router_overhead_bench_times_answered_requests_and_counts_failed_ones(launch):
    """bench_router_overhead.run_load: every answer a 404 (another model) is no timing, and the
    warm-up round's errors are not the run's."""
    import asyncio

    from loadtest.bench_router_overhead import run_load

    echo = launch.echo_backend()
    point = asyncio.run(run_load(echo.url, 2, 10, False))
    assert point["requests"] == 10 and point["errors"] == 0 and point["p99_ms"] > 0
    other = launch.echo_backend("--model", "other")
    with pytest.raises(RuntimeError, match="all 10 requests failed"):
        asyncio.run(run_load(other.url, 2, 10, False))
