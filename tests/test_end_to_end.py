"""Router + real radixgate workers (tiny model, CPU) as processes on loopback: the whole loop."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from router.kv_events import decode
from tests.support import REDIS, SilencingProxy, children, free_port, serve_in_thread, wait_until
from tests.worker.conftest import save_checkpoint

SYSTEM = "You are radixgate's test assistant. Answer in one short sentence, politely. " * 20  # ~1.5k tokens


def chat(user: str, model: str = "tiny", max_tokens: int = 4) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }


TOOLS = [
    {"type": "function", "function": {"name": f"tool_{i}", "description": f"Does task number {i} for the user. " * 4,
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"]}}}
    for i in range(8)
]  # fmt: skip
TOOLS_BYTES = len(orjson.dumps(TOOLS))  # ~2.3k byte tokens, rendered first


def agent(user: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "tools": TOOLS, "messages": [{"role": "user", "content": user}]}


def metric(url: str, name: str) -> float:
    """One series (a name, or a name with its labels) from a worker's or router's /metrics."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics")


def matched_tokens(router_url: str, body: dict) -> dict[str, int]:
    decision = httpx.post(router_url + "/debug/route", json=body, timeout=10).json()
    return {c["url"]: c["matched_tokens"] for c in decision["candidates"]}


def test_launch_workers_main_command_reuses_prefixes(launch):
    """`python -m router --launch-workers 2`: the README's main command, end to end."""
    router = launch.module("router", "--launch-workers", "2", timeout=120)
    # NOTE: both up: a worker that has told no model yet might serve any (the 404 below)
    wait_until(lambda: [(w["healthy"], w["models"]) for w in httpx.get(router.url + "/workers", timeout=2).json()["workers"]]
               == [(True, ["tiny"])] * 2, 120, what="both workers healthy")  # fmt: skip
    workers = [w["url"] for w in httpx.get(router.url + "/workers").json()["workers"]]
    assert len(workers) == 2
    # they serve this router only (loopback is every local user's): a key made for them, not asked for
    direct = httpx.post(workers[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(base_url=router.url, timeout=120) as client:
        first = client.post("/v1/chat/completions", json=chat("What is a radix tree?"))
        assert first.status_code == 200, first.text
        served = first.headers["x-radixgate-worker"]
        computed_before = metric(served, "radixgate_worker_prefill_computed_tokens_total")
        second = client.post("/v1/chat/completions", json=chat("And a KV cache?"))
        assert second.status_code == 200
        computed_after = metric(served, "radixgate_worker_prefill_computed_tokens_total")
    assert second.headers["x-radixgate-worker"] == served
    usage = second.json()["usage"]
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM)  # the system prompt was reused
    # The worker computed only the new part of the second prompt.
    assert (
        computed_after - computed_before
        <= usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    )
    assert metric(served, "radixgate_worker_cached_tokens_total") >= len(SYSTEM)

    # n choices with logprobs, streamed through the router: both choices arrive, usage counted once;
    # the router reads the usage chunk whether the client asked for it (OpenAI's default: not)
    usage_metric = f'radixgate_upstream_usage_prompt_tokens_total{{worker="{served}"}}'
    body = {**chat("Two answers?"), "n": 2, "stream": True, "logprobs": True, "top_logprobs": 2}
    prompt_tokens = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()["prompt_tokens"]
    for asked in (False, True):
        # NOTE: a health report taken while the last request ran counts as others' load until the
        # next one (1 s); wait for it so the prefix, not that stale load, decides the worker
        wait_until(lambda: idle(router.url, served), 10, what="the last request gone from the load")
        before = metric(router.url, usage_metric)
        sent = {**body, "stream_options": {"include_usage": True}} if asked else body
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=sent, timeout=120) as resp:
            assert resp.headers["x-radixgate-worker"] == served
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [orjson.loads(line) for line in lines[:-1]]
        done = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
        assert done == {0, 1}
        assert any(c["choices"][0]["logprobs"] for c in chunks if c["choices"])
        usage_chunks = [c for c in chunks if not c["choices"]]
        assert [c["usage"]["prompt_tokens"] for c in usage_chunks] == ([prompt_tokens] if asked else [])
        wait_until(lambda b=before: metric(router.url, usage_metric) == b + prompt_tokens, 10, what="usage")
    # /tokenize and /detokenize through the router: one worker answers (the tiny model's bytes)
    for path, body, answer in [
        ("/tokenize", {"model": "tiny", "prompt": "Héllo"}, {"tokens": list("Héllo".encode()), "count": 6}),
        ("/detokenize", {"tokens": [72, 105]}, {"prompt": "Hi"}),
    ]:
        via_router = httpx.post(router.url + path, json=body, timeout=10)
        assert via_router.status_code == 200 and via_router.headers["x-radixgate-worker"] in workers
        assert via_router.json().items() >= answer.items()
    assert httpx.post(router.url + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(router.url + "/tokenize", json={"prompt": 5}).status_code == 400  # the worker's answer
    router.stop()
    for url in workers:  # launched workers go down with the router
        wait_until(lambda url=url: not _answers(url), timeout=30, what=f"{url} stopped")


def idle(router_url: str, worker_url: str) -> bool:
    workers = httpx.get(router_url + "/workers", timeout=5).json()["workers"]
    return next(w["load"] for w in workers if w["url"] == worker_url) == 0


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _tiny_worker(launch, *extra: str):
    port = free_port()
    args = ["--model", "tiny", "--cpu-threads", "1", "--advertise-url", f"http://127.0.0.1:{port}", *extra]
    return launch.module("worker", *args, port=port, timeout=120)


def test_a_launched_worker_that_dies_is_started_again(launch):
    """`--launch-workers`: the router owns its workers; one killed (as by the OOM killer) is started
    again on its address and serves again; one that refuses its arguments is not (it would only
    fail again). Stopping the router stops them all."""
    router = launch.module("router", "--launch-workers", "1", "--model", "sim-8b", "--worker-arg=--engine=sim",
                           "--health-interval-s", "0.2", timeout=60)  # fmt: skip

    def row() -> dict:
        return httpx.get(router.url + "/workers", timeout=2).json()["workers"][0]

    wait_until(lambda: row()["healthy"], 60, what="the worker healthy")
    (child,) = children(router.proc.pid)
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: not row()["healthy"], 30, what="the dead worker seen")
    wait_until(lambda: row()["healthy"], 60, what="the worker started again")
    (again,) = children(router.proc.pid)
    assert again != child
    body = {"model": "sim-8b", "prompt": "served again", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert "exited with code -9" in router.log() and "starting it again in 1 s" in router.log()
    router.stop()
    assert children(router.proc.pid) == [] and router.proc.returncode is not None
    wait_until(lambda: _pid_gone(again), 15, what="the worker stopped with the router")

    # a router killed outright (SIGKILL, the OOM killer) runs no shutdown: its workers go with it anyway
    killed = launch.module("router", "--launch-workers", "1", "--model", "sim-8b", "--worker-arg=--engine=sim",
                           timeout=60)  # fmt: skip
    wait_until(lambda: len(children(killed.proc.pid)) == 1, 30, what="the worker started")
    (orphan,) = children(killed.proc.pid)
    killed.proc.kill()
    killed.proc.wait(10)
    wait_until(lambda: _pid_gone(orphan), 15, what="the worker stopped with the killed router")

    # a worker that refuses its model exits 2: not started again (flags it would refuse the router refuses
    # itself, before it starts: test_config)
    refused = launch.module("router", "--launch-workers", "1", "--model", "/nonexistent/model")
    wait_until(lambda: "not starting it again" in refused.log(), 30, what="the refused worker given up")
    time.sleep(1.5)  # NOTE: longer than the first restart delay
    assert children(refused.proc.pid) == [] and refused.proc.poll() is None  # the router keeps serving
    assert httpx.get(refused.url + "/health", timeout=5).status_code == 200


def _pid_gone(pid: int) -> bool:
    """The process has ended (a zombie not yet reaped by its parent, init for an orphan, counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("transport", ["http", pytest.param("redis", marks=pytest.mark.redis)])
def test_worker_cache_events_correct_the_router_index(launch, tmp_path, transport):
    """A prefix cached on a worker behind the router's back shows up in the router's index via
    KV events, and disappears when that worker flushes its cache."""
    extra: list[str] = []
    if transport == "redis":
        if REDIS is None:
            pytest.skip("redis-server not installed")
        extra = ["--redis-url", launch.redis()]
    a, b = _tiny_worker(launch, *extra), _tiny_worker(launch, *extra)
    router = launch.router([a.url, b.url], "--kv-events", transport, *extra)
    body = chat("Sent straight to worker b.")
    assert max(matched_tokens(router.url, body).values()) == 0
    wait_until(lambda: _resynced(router.url), 30, what="router subscribed to both workers")
    direct = httpx.post(b.url + "/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 200
    wait_until(
        lambda: matched_tokens(router.url, body)[b.url] >= len(SYSTEM), 30, what="stored event applied"
    )
    assert matched_tokens(router.url, body)[a.url] == 0
    count = metric(router.url, "radixgate_kv_event_lag_seconds_count")
    assert count >= 1 and 0 <= metric(router.url, "radixgate_kv_event_lag_seconds_sum") < 30 * count
    assert httpx.post(b.url + "/v1/cache/flush", timeout=30).status_code == 200
    wait_until(lambda: matched_tokens(router.url, body)[b.url] == 0, 30, what="flush reached the router")


def test_a_stopping_worker_ends_the_routers_event_streams_and_waits_for_nothing_else(launch):
    """SIGTERM with routers subscribed to its cache events over HTTP: the worker ends those streams
    (they never end by themselves), so its graceful shutdown finishes instead of running out its
    timeout and cancelling them."""
    workers = [launch.sim_worker(), launch.sim_worker()]
    router = launch.router([w.url for w in workers], "--kv-events", "http")
    wait_until(lambda: _resynced(router.url), 30, what="router subscribed to both workers")
    stopping = workers[0].proc
    stopping.terminate()
    assert stopping.wait(timeout=30) == -signal.SIGTERM  # NOTE: uvicorn re-raises the signal it handled
    log = workers[0].log()
    assert "Application shutdown complete" in log and "graceful shutdown exceeded" not in log, log[-2000:]


@pytest.mark.redis
def test_a_worker_started_after_the_router_is_followed_over_redis(launch):
    """Redis mode, the router up first (as when workers load a model for minutes): once the worker
    is healthy the router reads its model's stream and snapshot, so a flush reaches the index."""
    import redis

    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url, port = launch.redis(), free_port()
    url = f"http://127.0.0.1:{port}"
    router = launch.router(
        [url], "--kv-events", "redis", "--redis-url", redis_url, "--health-interval-s", "0.2"
    )
    worker = launch.module(
        "worker", "--engine", "sim", "--redis-url", redis_url, "--advertise-url", url, port=port
    )
    wait_until(lambda: httpx.get(router.url + "/workers", timeout=2).json()["workers"][0]["healthy"], 30,
               what="worker healthy")  # fmt: skip
    body = chat("Cached after the router started.")
    assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: matched_tokens(router.url, body)[url] >= len(SYSTEM), 30, what="routed prefix")
    assert httpx.post(worker.url + "/v1/cache/flush", timeout=30).status_code == 200
    wait_until(lambda: matched_tokens(router.url, body)[url] == 0, 30, what="the flush's event applied")
    assert metric(router.url, f'radixgate_upstream_kv_event_batches_total{{worker="{url}"}}') >= 1
    # one stream read, the worker's model's: none for a model that no worker serves
    readers = [c for c in redis.Redis.from_url(redis_url).client_list() if c["cmd"] in ("xread", "xrevrange")]
    assert len(readers) == 1, readers


@pytest.mark.redis
@pytest.mark.parametrize("publishes", [True, False], ids=["worker-publishes", "worker-silent"])
def test_a_flush_while_redis_is_down_reaches_the_index_once_it_is_back(launch, publishes):
    """Redis restarts (no persistence, as the chart's bundled one) while a worker flushes its cache,
    and no request follows. The worker keeps the batch Redis refused and sends it when Redis is
    back; the router, whose stream read failed meanwhile, re-syncs the stream's workers from their
    snapshots: with a worker that publishes nothing (``worker-silent``, its batches as good as
    lost) the router's re-sync alone corrects the index."""
    from tests.support import start_redis

    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_port, port = free_port(), free_port()
    redis_url, url = f"redis://127.0.0.1:{redis_port}/0", f"http://127.0.0.1:{port}"
    redis = start_redis(redis_port)
    try:
        publish = ["--redis-url", redis_url] if publishes else []
        worker = launch.module("worker", "--engine", "sim", *publish, "--advertise-url", url, port=port)
        # NOTE: health checks 60 s apart: the seq in the worker's health report (the next test)
        # would otherwise correct the index before Redis is back, and this test is about Redis
        router = launch.router(
            [url], "--kv-events", "redis", "--redis-url", redis_url, "--health-interval-s", "60"
        )
        wait_until(lambda: httpx.get(router.url + "/workers", timeout=2).json()["workers"][0]["healthy"], 30,
                   what="worker healthy")  # fmt: skip
        body = chat("Cached before Redis restarts.")
        assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: matched_tokens(router.url, body)[url] >= len(SYSTEM), 30, what="routed prefix")
        redis.terminate()
        redis.wait(10)
        assert httpx.post(worker.url + "/v1/cache/flush", timeout=30).json()["flushed_tokens"] > 0
        time.sleep(1.0)  # NOTE: the worker's publish and the router's read both fail meanwhile
        assert matched_tokens(router.url, body)[url] >= len(SYSTEM)
        redis = start_redis(redis_port)
        wait_until(lambda: matched_tokens(router.url, body)[url] == 0, 30, what="the index corrected")
    finally:
        redis.terminate()
        redis.wait(10)


@pytest.mark.redis
def test_a_batch_trimmed_off_the_stream_before_the_router_read_it_is_noticed(launch):
    """A router that reads a model's Redis Stream too slowly (frozen here) loses the batches the
    workers' ``--stream-maxlen`` trimmed off meanwhile: a flush of a worker that then stays idle
    would show no gap. The worker's health report names its last seq, so the router notices the
    batch it never got and re-syncs that worker."""
    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    idle, busy = (launch.sim_worker("--redis-url", redis_url, "--stream-maxlen", "10") for _ in range(2))
    router = launch.router([idle.url, busy.url], "--kv-events", "redis", "--redis-url", redis_url)
    wait_until(lambda: all(w["healthy"] for w in httpx.get(router.url + "/workers", timeout=2).json()["workers"]),
               30, what="workers healthy")  # fmt: skip
    body = {"model": "sim-8b", "prompt": SYSTEM, "max_tokens": 2}
    assert httpx.post(idle.url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_until(
        lambda: matched_tokens(router.url, body)[idle.url] >= 1024, 30, what="the idle worker's prefix"
    )

    def publish_on_busy(n: int) -> None:  # a new prompt each: one stored batch each
        for _ in range(n):
            prompt = os.urandom(48).hex()
            assert httpx.post(busy.url + "/v1/completions", json={"model": "sim-8b", "prompt": prompt,
                                                                  "max_tokens": 1}, timeout=30).status_code == 200  # fmt: skip

    router.proc.send_signal(signal.SIGSTOP)
    try:
        publish_on_busy(1)  # NOTE: answers the router's blocked read (in its socket, read on waking)
        time.sleep(0.3)
        assert httpx.post(idle.url + "/v1/cache/flush", timeout=30).json()["flushed_tokens"] > 0
        publish_on_busy(30)  # the flush's batch is trimmed off the 10-entry stream
    finally:
        router.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: matched_tokens(router.url, body)[idle.url] == 0, 15, what="the index corrected")
    assert "never arrived" in router.log()


@pytest.mark.redis
def test_a_worker_whose_events_never_reach_redis_is_warned_about_and_followed_by_snapshots(launch):
    """A worker started without the router's --redis-url publishes no batch to the stream the
    router reads: the router says so once and follows it by snapshots (its health reports the seq)."""
    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    worker = launch.sim_worker()
    router = launch.router([worker.url], "--kv-events", "redis", "--redis-url", redis_url)
    wait_until(lambda: httpx.get(router.url + "/workers", timeout=2).json()["workers"][0]["healthy"], 30,
               what="worker healthy")  # fmt: skip
    body = {"model": "sim-8b", "prompt": SYSTEM, "max_tokens": 2}
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_until(
        lambda: matched_tokens(router.url, body)[worker.url] >= 1024, 15, what="the prefix from a snapshot"
    )
    assert httpx.post(worker.url + "/v1/cache/flush", timeout=30).json()["flushed_tokens"] > 0
    wait_until(
        lambda: matched_tokens(router.url, body)[worker.url] == 0, 15, what="the flush from a snapshot"
    )
    assert router.log().count("none has arrived from Redis") == 1
    # removed and added again at its URL: a worker of its own, warned about afresh
    assert httpx.delete(router.url + "/workers", params={"url": worker.url}, timeout=5).status_code == 200
    assert httpx.post(router.url + "/workers", json={"url": worker.url}, timeout=5).status_code == 201
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_until(lambda: router.log().count("none has arrived from Redis") == 2, 15, what="the warning again")


def test_an_event_stream_dropped_on_the_way_is_opened_again(launch):
    """A connection a NAT or a firewall forgot ends at neither side: the router's HTTP event stream over
    it goes silent (not even the worker's pings come). Silent past event_stream_timeout_s it is opened
    again, and the worker's batches are followed again, not only its snapshots after a lost batch."""
    worker = launch.sim_worker()
    proxy = SilencingProxy(int(worker.url.rsplit(":", 1)[1]))
    router = launch.router([proxy.url], "--kv-events", "http", env={"RADIXGATE_EVENT_STREAM_TIMEOUT_S": "1"})
    batches = f'radixgate_upstream_kv_event_batches_total{{worker="{proxy.url}"}}'
    resyncs = f'radixgate_upstream_kv_resyncs_total{{worker="{proxy.url}"}}'
    sent = iter(range(1000))

    def a_batch_applied(before: float) -> bool:
        body = {"model": "sim-8b", "prompt": f"{next(sent)} " + SYSTEM, "max_tokens": 2}
        assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
        return metric(router.url, batches) > before

    wait_until(lambda: metric(router.url, resyncs) >= 1, 30, what="the first snapshot")
    wait_until(lambda: a_batch_applied(0), 30, interval=0.5, what="a batch over the stream")
    proxy.silence()
    before = metric(router.url, resyncs)
    wait_until(lambda: metric(router.url, resyncs) > before, 30, what="the stream opened again")
    applied = metric(router.url, batches)
    wait_until(lambda: a_batch_applied(applied), 30, interval=0.5, what="a batch over the new stream")


def test_a_router_behind_a_worker_re_syncs_it_only_when_its_events_stop_coming():
    """A cursor behind the seq a worker reported: re-synced when it has not moved for a whole
    health interval (a lost batch), not while batches are still being applied (a reader that lags)."""
    import asyncio

    from router.config import RouterConfig
    from router.event_subscriber import _Cursor
    from router.gateway import Router

    async def run() -> tuple[bool, bool, bool]:
        router = Router(RouterConfig(workers=["http://w:1"], kv_events="http"))
        events, worker = router.events, router.workers.get("http://w:1")
        events._cursors[worker.url] = _Cursor("e1", 5)
        events.reported_seq(worker, "e1", 9)  # first report: nothing to compare with
        events._cursors[worker.url].seq = 7  # the reader applied two batches meanwhile
        events.reported_seq(worker, "e1", 12)
        lagging = events._holding(worker)
        events.reported_seq(worker, "e1", 12)  # stuck at 7 since the report of 12
        stuck = events._holding(worker)
        events._held.clear()
        events._cursors[worker.url] = _Cursor("e1", 12)
        events.reported_seq(worker, "e1", 12)
        events.reported_seq(worker, "e1", 12)
        caught_up = events._holding(worker)
        for task in list(events._resyncs):
            task.cancel()
        return lagging, stuck, caught_up

    assert asyncio.run(run()) == (False, True, False)


def test_re_syncs_for_lost_batches_back_off_while_none_arrive():
    """Redis down, or a worker publishing nowhere: each health report shows its seq ahead of the
    cursor. One re-sync, then none for 2 s, then waits doubling (to 30 s) while no batch arrives;
    a batch applied again ends the back-off."""
    import asyncio

    from router.config import RouterConfig
    from router.event_subscriber import _Cursor
    from router.gateway import Router
    from router.kv_events import KVEventBatch

    async def run() -> list:
        router = Router(RouterConfig(workers=["http://w:1"], kv_events="http"))
        events, worker = router.events, router.workers.get("http://w:1")
        started = []

        def reports(n: int) -> int:
            """``n`` health reports, each a batch further ahead; how many re-syncs they started."""
            count = 0
            for _ in range(n):
                cursor = events._cursors.setdefault(worker.url, _Cursor("e1", 5))
                told = events._reported.get(worker.url, ("e1", 5, 5))[1]
                events.reported_seq(worker, "e1", told + 1)
                if events._holding(worker):  # NOTE: a re-sync started; say it ended, the cursor where it was
                    count += 1
                    events._held.clear()
                    events._cursors[worker.url] = cursor
            return count

        started.append(reports(10))
        started.append(events._lost_wait[worker.url][1])
        events._lost_wait[worker.url] = (0.0, events._lost_wait[worker.url][1])  # NOTE: its wait is over
        started.append(reports(10))
        started.append(events._lost_wait[worker.url][1])
        seq = events._cursors[worker.url].seq
        assert events.apply(worker, KVEventBatch(worker.url, "e1", seq + 1, 0.0, 16))
        started.append(worker.url in events._lost_wait)
        for task in list(events._resyncs):
            task.cancel()
        return started

    assert asyncio.run(run()) == [1, 2.0, 1, 4.0, False]


@pytest.mark.redis
def test_a_worker_removed_and_added_again_before_its_snapshot_came_is_synced(launch):
    """DELETE and POST /workers (or a pod replaced under its name) while the first re-sync of the
    worker at that URL still reads its snapshot: the new worker gets its own re-sync; the earlier
    one, for a worker gone, changes nothing."""
    import asyncio

    from router.config import RouterConfig
    from router.gateway import Router

    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--redis-url", redis_url)
    body = {"model": "sim-8b", "prompt": "held before the worker came back " * 40, "max_tokens": 1}
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
    slow = _SlowSnapshotProxy(worker.url, delay_s=2.0)  # NOTE: health checks come meanwhile (1 s)
    try:

        async def run() -> tuple[bool, int, int]:
            router = Router(RouterConfig(workers=[], kv_events="redis", redis_url=redis_url))
            await router.start()
            try:
                first = router.workers.add(slow.url)
                router.workers.remove(slow.url)  # NOTE: its re-sync has not read the snapshot yet
                again = router.workers.add(slow.url)
                router.events.resync_soon(first)  # NOTE: as a late health check of the first would ask
                assert router.events._holding(again)
                for _ in range(200):
                    if router.events.synced(again):
                        break
                    await asyncio.sleep(0.05)
                route = router.route_request(router.parse(orjson.dumps(body), "completions"))
                matched = router.index.match(route.block_hashes).get(slow.url, 0)
                return router.events.synced(again), matched, len(route.block_hashes)
            finally:
                await router.stop()

        synced, matched, blocks = asyncio.run(run())
    finally:
        slow.close()
    assert synced and blocks >= 70 and matched == blocks


class _SlowSnapshotProxy:
    """A worker's GET endpoints passed through, its cache snapshot ``delay_s`` late (a large cache
    on a busy worker)."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        import asyncio

        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def forward(request):
            if request.url.path == "/v1/cache/snapshot":
                await asyncio.sleep(delay_s)
            async with httpx.AsyncClient() as client:
                r = await client.get(upstream + request.url.path, timeout=30)
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward)])
        self.url, self.server = serve_in_thread(app, "the slow-snapshot proxy")

    def close(self) -> None:
        self.server.should_exit = True


def test_a_router_serves_its_first_request_knowing_the_caches_its_workers_already_hold(launch):
    """A router started beside workers that already hold prefixes (a restart, a replica added):
    its start-up ends once their snapshots are in the index, so no first request goes blind."""
    import asyncio

    from router.config import RouterConfig
    from router.gateway import Router

    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    body = {"model": "sim-8b", "prompt": "held before the router started " * 40, "max_tokens": 1}
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200

    async def run() -> tuple[int, int]:
        router = Router(RouterConfig(workers=[worker.url], kv_events="http"))
        await router.start()
        try:
            route = router.route_request(router.parse(orjson.dumps(body), "completions"))
            return router.index.match(route.block_hashes).get(worker.url, 0), len(route.block_hashes)
        finally:
            await router.stop()

    matched, blocks = asyncio.run(run())
    assert blocks >= 70 and matched == blocks


def _abandon(
    launch, worker_args: list[str], prompt: Callable[[int], str], timeouts: list[float], first: bool = False
) -> tuple[list[str], float]:
    """Send ``prompt(i)`` with client timeout ``timeouts[i]`` (half of them streamed) through a
    router to one sim worker (with ``first``, the others once the worker has request 0); once the
    worker is idle, wait for the router's index to equal the worker's cache. Returns each request's
    outcome and the worker's cached pages."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", *worker_args)
    router = launch.router([worker.url])
    wait_until(lambda: metric(router.url, "radixgate_upstream_kv_resyncs_total"
                              f'{{worker="{worker.url}"}}') >= 1, 30, what="the worker synced")  # fmt: skip

    def has_work() -> bool:
        health = httpx.get(worker.url + "/health", timeout=5).json()
        return health["running"] + health["waiting"] > 0

    def send(i: int) -> str:
        if first and i:
            wait_until(has_work, 10, interval=0.02, what="request 0 at the worker")
        body = {"model": "sim-8b", "prompt": prompt(i), "max_tokens": 2, "stream": i % 2 == 0}
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=timeouts[i]) as resp:
                resp.read()
            return "answered"
        except httpx.TimeoutException:
            return "left"

    with ThreadPoolExecutor(len(timeouts)) as pool:
        outcomes = list(pool.map(send, range(len(timeouts))))
    wait_until(lambda: idle(router.url, worker.url), 30, what="the worker idle")

    def pages() -> tuple[float, float]:
        cached = httpx.get(worker.url + "/health", timeout=5).json()["kv_pages_cached"]
        return metric(router.url, "radixgate_prefix_index_entries"), cached

    wait_until(lambda: pages()[0] == pages()[1], 10, what="the index equal to the worker's cache")
    return outcomes, pages()[1]


def test_requests_whose_clients_left_them_queued_leave_no_prefix_in_the_index(launch):
    """Clients that give up on requests still queued at the worker (streamed or not): the router takes
    their optimistic inserts back, and the worker's KV events put back what it did compute, so
    the index ends equal to the worker's cache instead of holding prompts never computed."""
    # NOTE: ~1,820 tokens, under 2,048: one prefill chunk, so a request is computed whole or not at all
    outcomes, cached = _abandon(
        launch, ["--max-running", "1"], lambda i: f"{i:03d} queued and abandoned " * 70, [0.5] * 16
    )
    assert outcomes.count("left") >= 8, outcomes  # ~140 ms of prefill each, one at a time
    assert cached < 16 * 113  # not every prompt was computed (113 full blocks each)


def test_requests_whose_clients_left_between_prefill_chunks_leave_only_the_computed_chunks(launch):
    """Clients that give up while their long prompts are partway through prefill: the worker's
    stored events for the chunks it computed keep exactly those blocks in the index, and the
    take-back removes the rest, so the index ends equal to the worker's cache."""
    # NOTE: 8 prefill chunks of ~130 ms each; every client leaves at its own point of them
    args = ["--max-running", "4", "--chunked-prefill-tokens", "256", "--sim-prefill-ms-per-token", "0.5"]
    outcomes, cached = _abandon(
        launch, args, lambda i: f"{i:03d} left partway through " * 70, [0.3 + 0.2 * i for i in range(8)]
    )
    assert outcomes.count("left") >= 4, outcomes
    assert 0 < cached < 8 * 113  # some chunks were computed, not every prompt (113 full blocks each)


def test_a_document_every_request_abandoned_in_the_queue_leaves_the_index(launch):
    """Requests sharing a document queue behind a long one; the later ones are routed to the worker
    because the first one's insert put the document there. All are abandoned in the queue, so the
    document is never computed: the last take-back removes it too (no stored event named it), and
    the index does not keep predicting it there."""
    # NOTE: request 0 (~4,000 tokens at 1 ms a token) runs alone for ~4 s; the rest wait behind it
    args = ["--max-running", "1", "--sim-prefill-ms-per-token", "1"]

    def prompt(i: int) -> str:
        return "the long one ahead " * 210 if i == 0 else "one shared document " * 90 + f"question {i}"

    outcomes, cached = _abandon(launch, args, prompt, [15.0] + [0.5] * 8, first=True)
    assert outcomes == ["answered"] + ["left"] * 8
    assert 0 < cached < 300  # request 0's prompt only (~250 pages): the document was never computed


class _SlowSnapshotWorker:
    """A worker that answers its probes but never its snapshot, and publishes batches with gaps to
    the same Redis stream as a real worker (as one whose HTTP side is overloaded would)."""

    def __init__(self, redis_url: str) -> None:
        import asyncio
        import threading

        import redis
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from router.kv_events import KVEventBatch, encode

        async def snapshot(request):
            await asyncio.sleep(60)

        app = Starlette(routes=[
            Route("/health", lambda r: JSONResponse({"status": "ok", "running": 0, "waiting": 0})),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "sim-8b"}]})),
            Route("/v1/cache/info", lambda r: JSONResponse({"block_size": 16})),
            Route("/v1/cache/snapshot", snapshot),
        ])  # fmt: skip
        self.url, self.server = serve_in_thread(app, "the slow-snapshot worker")
        self.stop = threading.Event()
        client = redis.Redis.from_url(redis_url)

        def publish() -> None:
            seq = 0
            while not self.stop.wait(0.2):
                seq += 2  # NOTE: every batch a gap: each asks the router for a re-sync
                batch = KVEventBatch(self.url, "e1", seq, time.time(), 16)
                client.xadd("radixgate:kv:sim-8b", {"batch": encode(batch)})

        threading.Thread(target=publish, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.should_exit = True


@pytest.mark.redis
def test_a_worker_whose_snapshot_hangs_delays_no_other_workers_events(launch):
    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    real = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--redis-url", redis_url,
                         "--advertise-url", url, port=port)  # fmt: skip
    slow = _SlowSnapshotWorker(redis_url)
    try:
        router = launch.router([url, slow.url], "--kv-events", "redis", "--redis-url", redis_url)
        # NOTE: its start-up waited for the real worker's snapshot and gave up on the slow one's
        assert f"serving before the cache snapshots of {slow.url} arrived" in router.log()
        wait_until(lambda: metric(router.url, f'radixgate_upstream_kv_resyncs_total{{worker="{url}"}}') >= 1,
                   30, what="the real worker synced")  # fmt: skip
        body = {"model": "sim-8b", "prompt": "cached behind the router's back " * 8, "max_tokens": 1}
        assert httpx.post(real.url + "/v1/completions", json=body, timeout=30).status_code == 200
        wait_until(lambda: matched_tokens(router.url, body)[url] >= 128, 8, what="the real worker's event")
    finally:
        slow.close()


def _resynced(router_url: str) -> bool:
    text = httpx.get(router_url + "/metrics", timeout=5).text
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("radixgate_upstream_kv_resyncs")
    ]
    return len(values) == 2 and all(v >= 1 for v in values)


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_router_predicts_the_block_hashes_the_worker_stores(launch, tmp_path, tokenizer):
    """Contract 2: for the same request, the router's predicted block hashes are exactly the ones
    the worker stores (tiny + bytes, and an HF checkpoint + its tokenizer.json and chat template)."""
    if tokenizer == "hf":
        model_dir = save_checkpoint(tmp_path / "ckpt", "llama", max_position_embeddings=4096)
        worker = launch.module("worker", "--model", str(model_dir), "--cpu-threads", "1", timeout=120)
        router = launch.router([worker.url], "--tokenizer", str(model_dir))
        model = model_dir.name
    else:
        worker = _tiny_worker(launch)
        router = launch.router([worker.url])
        model = "tiny"
    body = {**chat("Which hashes?", model=model), "tools": TOOLS[:2]}  # tools are part of the prompt
    # an assistant prefill: the last message left open, no generation prompt
    prefill = chat("And a prefill?", model=model)
    prefill["messages"].append({"role": "assistant", "content": "The answer, in one word, is"})
    prefill["continue_final_message"] = True
    for b in (body, prefill):
        predicted = httpx.post(router.url + "/debug/route", json=b, timeout=10).json()
        assert httpx.post(router.url + "/v1/chat/completions", json=b, timeout=120).status_code == 200
        stored = decode(httpx.get(worker.url + "/v1/cache/snapshot", timeout=10).content)
        stored_hashes = {h for run in stored.stored for h in run.block_hashes}
        router_hashes = [int(h) for h in predicted["block_hashes"]]
        assert len(router_hashes) >= 8
        assert predicted["block_size"] == stored.block_size
        assert set(router_hashes) <= stored_hashes


def _hf_worker(launch, tmp_path, **overrides):
    """A worker of a tiny HF checkpoint (its own BPE tokenizer): a router counting bytes counts its
    prompts otherwise. Returns the worker and its model's name."""
    model_dir = save_checkpoint(tmp_path / "ckpt", "llama", **{"max_position_embeddings": 4096, **overrides})
    worker = launch.module("worker", "--model", str(model_dir), "--cpu-threads", "1", timeout=120)
    return worker, model_dir.name


def test_a_refusal_keeps_the_prefix_predicted_where_the_index_cannot_match_the_events(launch, tmp_path):
    """A worker with its own tokenizer behind a bytes router: its KV events name blocks the router
    never hashes, so the index keeps the router's own predictions for it, as for a worker without
    events. A refused request takes back its own tail, not the prefix an earlier answer put there."""
    worker, model = _hf_worker(launch, tmp_path)
    router = launch.router([worker.url])
    body = {"model": model, "prompt": "a document the worker keeps in its cache " * 6, "max_tokens": 1}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=120).status_code == 200
    held = matched_tokens(router.url, body)[worker.url]
    assert held >= 224
    refused = {**body, "prompt": body["prompt"] + "and more", "max_tokens": "many"}
    assert httpx.post(router.url + "/v1/completions", json=refused, timeout=120).status_code == 400
    assert matched_tokens(router.url, body)[worker.url] == held


def test_bytes_past_the_context_of_a_worker_counting_otherwise_are_recorded(launch, tmp_path):
    """A bytes router in front of a worker with its own tokenizer (512 of its tokens of context): a
    prompt of more bytes than that is still well inside the context, so the index records all of it
    (two documents after a long shared system prompt stay told apart), and one sent with
    truncate_prompt_tokens -1 is not taken as cut to fit."""
    worker, model = _hf_worker(launch, tmp_path, max_position_embeddings=512)
    router = launch.router([worker.url])
    listed = httpx.get(worker.url + "/v1/models", timeout=5).json()["data"]
    assert listed[0]["max_model_len"] == 512
    system = "Cache-aware routing sends shared prefixes to the worker that already holds them. " * 8  # 648 B
    one = {"model": model, "max_tokens": 1}
    sent = {**one, "prompt": system + "The quick brown fox jumps over the lazy dog. " * 3}
    never = {
        **one,
        "prompt": system + "Paged attention stores keys and values in fixed-size pages of tokens. " * 2,
    }
    answer = httpx.post(router.url + "/v1/completions", json=sent, timeout=120).json()
    assert answer["usage"]["prompt_tokens"] < 512 < len(sent["prompt"])
    assert matched_tokens(router.url, sent)[worker.url] > matched_tokens(router.url, never)[worker.url] >= 640
    whole = {
        **one,
        "prompt": "The quick brown fox jumps over the lazy dog. " * 14,
        "truncate_prompt_tokens": -1,
    }
    answer = httpx.post(router.url + "/v1/completions", json=whole, timeout=120).json()
    assert answer["usage"]["prompt_tokens"] < 512 < len(whole["prompt"])  # the worker kept it whole
    assert matched_tokens(router.url, whole)[worker.url] >= 608


def test_debug_route_predicts_the_cached_tokens_the_worker_reports(launch):
    """/debug/route's predicted_cached_tokens are the router's own count, which the worker's usage
    confirms: a prompt of whole blocks computes its last block (the index holds all of it)."""
    worker = _tiny_worker(launch)
    router = launch.router([worker.url])
    body = {"model": "tiny", "prompt": "x" * 63 + "y", "max_tokens": 1}  # 64 bytes: 4 whole blocks
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=120).status_code == 200
    explained = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
    (candidate,) = explained["candidates"]
    assert candidate["matched_tokens"] == 64 and candidate["predicted_cached_tokens"] == 48
    assert explained["predicted_cached_tokens"] == 48
    answer = httpx.post(router.url + "/v1/completions", json=body, timeout=120).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_a_cache_salt_keeps_its_prefixes_its_own_at_the_router_and_the_worker(launch):
    """vLLM's cache_salt: the router predicts the salted hashes the worker stores; a request with
    another salt or none matches none of them at either (no cached tokens), the same salt does."""
    worker = _tiny_worker(launch)
    router = launch.router([worker.url])
    salted_chat = {**chat("Salted?"), "cache_salt": "tenant-a"}
    predicted = httpx.post(router.url + "/debug/route", json=salted_chat, timeout=10).json()
    assert httpx.post(router.url + "/v1/chat/completions", json=salted_chat, timeout=120).status_code == 200
    stored = decode(httpx.get(worker.url + "/v1/cache/snapshot", timeout=10).content)
    assert set(map(int, predicted["block_hashes"])) <= {h for run in stored.stored for h in run.block_hashes}
    for other in ({**chat("Salted?"), "cache_salt": "tenant-b"}, chat("Salted?")):
        assert matched_tokens(router.url, other)[worker.url] == 0
        answer = httpx.post(router.url + "/v1/chat/completions", json=other, timeout=120).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = {**chat("Salted again?"), "cache_salt": "tenant-a"}
    assert matched_tokens(router.url, again)[worker.url] >= len(SYSTEM)
    answer = httpx.post(router.url + "/v1/chat/completions", json=again, timeout=120).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM)
    # a salted prompt the worker got behind the router's back reaches its index by KV events, for that salt
    direct = {**chat("Sent straight to the worker."), "cache_salt": "tenant-z"}
    assert httpx.post(worker.url + "/v1/chat/completions", json=direct, timeout=120).status_code == 200
    wait_until(
        lambda: matched_tokens(router.url, direct)[worker.url] >= len(SYSTEM), 30, what="salted event applied"
    )
    assert matched_tokens(router.url, {**direct, "cache_salt": "tenant-y"})[worker.url] == 0
    bad = httpx.post(router.url + "/v1/chat/completions", json={**again, "cache_salt": ""}, timeout=10)
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


def test_a_shared_tool_set_is_a_shared_prefix_the_router_routes_by(launch):
    """Agents that share a long tool set but not their messages: the router renders the tools into
    the prompt as the worker does, so the second conversation goes where the tools are cached."""
    workers = [_tiny_worker(launch), _tiny_worker(launch)]
    router = launch.router([w.url for w in workers])
    with httpx.Client(base_url=router.url, timeout=120) as client:
        first = client.post("/v1/chat/completions", json=agent("Book a table for two."))
        assert first.status_code == 200, first.text
        holder = first.headers["x-radixgate-worker"]
        second_body = agent("What is the weather in Oslo?")
        wait_until(lambda: matched_tokens(router.url, second_body)[holder] >= TOOLS_BYTES - 64, 30,
                   what="the tool prefix in the router's index")  # fmt: skip
        second = client.post("/v1/chat/completions", json=second_body)
    assert second.headers["x-radixgate-worker"] == holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= TOOLS_BYTES - 64


def test_workers_behind_an_api_key_serve_the_router_that_holds_it(launch):
    """`--worker-api-key` with `--launch-workers`: the workers started require the key (passed in
    their environment), the router sends it on requests, health checks and the KV event stream,
    and a client without it reaches nothing but the probes."""
    key = "w0rker-k3y"
    router = launch.module("router", "--launch-workers", "1", "--worker-api-key", key, "--api-key", "client-key",
                           timeout=120)  # fmt: skip
    wait_until(lambda: httpx.get(router.url + "/ready", timeout=2).status_code == 200, 120, what="ready")
    client = {"authorization": "Bearer client-key"}
    assert (
        httpx.get(router.url + "/workers").status_code == 401
    )  # no key, no admin token: no view of the fleet
    [worker] = [w["url"] for w in httpx.get(router.url + "/workers", headers=client).json()["workers"]]
    body = chat("Who holds the key?")
    answer = httpx.post(router.url + "/v1/chat/completions", json=body, headers=client, timeout=120)
    assert answer.status_code == 200, answer.text
    tokens = httpx.post(router.url + "/tokenize", json={"prompt": "keyed"}, headers=client, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["count"] == 5
    for path in ("/v1/chat/completions", "/v1/cache/info"):  # the client's key is not the workers'
        direct = httpx.request("POST" if "chat" in path else "GET", worker + path, json=body, headers=client)
        assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_api_key"
    assert (
        httpx.get(worker + "/health").status_code == 200 and httpx.get(worker + "/metrics").status_code == 200
    )
    # the event stream is subscribed (and the snapshot read) with the key; then a new prompt's events arrive
    wait_until(lambda: metric(router.url, f'radixgate_upstream_kv_resyncs_total{{worker="{worker}"}}') >= 1, 30,
               what="the key-protected KV snapshot")  # fmt: skip
    second = httpx.post(router.url + "/v1/chat/completions", json=chat("Another question? " * 10), headers=client,
                        timeout=120)  # fmt: skip
    assert second.status_code == 200
    wait_until(lambda: metric(router.url, "radixgate_kv_event_lag_seconds_count") >= 1, 30,
               what="KV events over the key-protected stream")  # fmt: skip


def test_prefill_sent_by_another_router_shows_in_this_routers_load(launch):
    """A sim worker prefills slowly a prompt sent to it directly (as another router replica would):
    its /health reports the prefill backlog, and the router counts what exceeds its own (nothing
    here) in the worker's load until the prefill is done."""
    port = free_port()
    worker = launch.module(
        "worker", "--engine", "sim", "--sim-prefill-ms-per-token", "20", "--chunked-prefill-tokens", "32",
        "--advertise-url", f"http://127.0.0.1:{port}", port=port,
    )  # fmt: skip
    router = launch.router([worker.url], "--health-interval-s", "0.1", "--prefill-tokens-per-load", "100")
    prompt = "x" * 300  # byte tokens: ~6 s of prefill, 32 tokens per step
    with ThreadPoolExecutor(1) as pool:
        direct = pool.submit(
            httpx.post, worker.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
            timeout=60,
        )  # fmt: skip
        wait_until(lambda: 0 < httpx.get(worker.url + "/health").json()["prefill_backlog_tokens"] < 300, 30,
                   what="the worker prefilling")  # fmt: skip

        def view() -> dict:
            return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]

        wait_until(lambda: view()["reported_prefill_tokens"] > 0, 30, what="the backlog in the router's view")
        w = view()
        assert (w["in_flight"], w["pending_prefill_tokens"], w["reported_queue"]) == (0, 0, 1)
        assert 0 < w["reported_prefill_tokens"] <= 300
        assert w["load"] == pytest.approx(1 + w["reported_prefill_tokens"] / 100)
        assert direct.result().status_code == 200
    wait_until(lambda: view()["load"] == 0, 30, what="the load gone with the request")


def test_n_choices_and_batched_prompts_count_as_the_sequences_the_worker_runs(launch):
    """The router's in-flight count (its load) counts n choices x prompts, as many as the worker
    runs, so the health report's running + waiting adds nothing "from others" for them."""
    port = free_port()
    worker = launch.module(
        "worker", "--engine", "sim", "--sim-prefill-ms-per-token", "10", "--chunked-prefill-tokens", "32",
        "--advertise-url", f"http://127.0.0.1:{port}", port=port,
    )  # fmt: skip
    router = launch.router([worker.url], "--health-interval-s", "0.1")

    def view() -> dict:
        return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]

    bodies = [
        ({"model": "tiny", "prompt": "y" * 200, "max_tokens": 2, "n": 3}, 3),
        ({"model": "tiny", "prompt": ["a" * 100, "b" * 100], "max_tokens": 2, "n": 2}, 4),
    ]
    for body, sequences in bodies:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, router.url + "/v1/completions", json=body, timeout=60)
            wait_until(lambda: view()["in_flight"] > 0, 30, what="the request in flight")
            assert view()["in_flight"] == sequences
            wait_until(lambda n=sequences: view()["reported_queue"] == n, 30, what="the worker's report")
            w = view()
            assert w["in_flight"] == sequences and w["others_queue"] == 0  # nothing "from others"
            # both count a prompt's prefill once for its n choices, and every prompt of a batch
            assert w["pending_prefill_tokens"] == 200 and w["others_prefill_tokens"] == 0
            resp = sent.result()
            assert resp.status_code == 200 and len(resp.json()["choices"]) == sequences
        wait_until(lambda: view()["in_flight"] == 0, 10, what="the count released")


def test_a_request_sent_away_from_its_prefix_fetches_the_kv_from_the_holder(launch):
    """`--kv-fetch-min-tokens`: round robin sends the second request of a shared system prompt to
    the other worker; the router names the first as the KV source, the second worker fetches the
    prefix from it (behind the workers' key) instead of computing it, and answers the same."""
    key = "fleet-k3y"
    router = launch.module("router", "--launch-workers", "2", "--policy", "round_robin", "--kv-fetch-min-tokens",
                           "64", "--worker-api-key", key, "--access-log", timeout=120)  # fmt: skip
    wait_until(lambda: [w["healthy"] for w in httpx.get(router.url + "/workers", timeout=2).json()["workers"]]
               == [True, True], 120, what="both workers healthy")  # fmt: skip
    first = httpx.post(router.url + "/v1/chat/completions", json=chat("Where is the cache?"), timeout=120)
    holder = first.headers["x-radixgate-worker"]
    body = chat("Where is the KV?")
    second = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    assert second.status_code == 200, second.text
    other = second.headers["x-radixgate-worker"]
    assert other != holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // 16 * 16
    auth = {"authorization": f"Bearer {key}"}
    fetched = httpx.get(other + "/metrics", headers=auth).text
    assert 'radixgate_worker_kv_fetch_total{outcome="ok"} 1.0' in fetched
    assert metric(router.url, f'radixgate_upstream_kv_fetch_hints_total{{worker="{other}"}}') == 1
    assert metric(router.url, f'radixgate_upstream_kv_fetch_hints_total{{worker="{holder}"}}') == 0

    wait_until(lambda: len(router.access_lines()) == 2, 10, what="two access lines")
    assert [a["kv_source"] for a in router.access_lines()] == [None, holder]
    # the same answer as the holder computes for it
    direct = httpx.post(holder + "/v1/chat/completions", json=body, headers=auth, timeout=120).json()
    assert direct["choices"][0]["message"] == second.json()["choices"][0]["message"]
    # both hold the prefix now: no source is named for it; /debug/route names one for a new prefix
    assert httpx.post(router.url + "/debug/route", json=chat("Now?"), timeout=10).json()["kv_source"] is None
    fresh = {**body, "messages": [{"role": "system", "content": "A new system prompt. " * 20}]}
    assert httpx.post(router.url + "/v1/chat/completions", json=fresh, timeout=120).status_code == 200
    explained = httpx.post(router.url + "/debug/route", json=fresh, timeout=10).json()
    assert explained["kv_source"] is not None and explained["kv_source"] != explained["worker"]


@pytest.mark.redis
def test_a_failed_resync_of_a_worker_whose_batches_miss_redis_is_tried_again(launch):
    """In Redis mode, a worker whose batches never reach Redis (started without --redis-url) is
    followed by snapshots alone: one snapshot that fails (late behind a long step) must not leave
    the index without that worker's cache for good."""
    if REDIS is None:
        pytest.skip("redis-server not installed")
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    worker = launch.sim_worker()
    body = {"model": "sim-8b", "prompt": "held before the router started " * 40, "max_tokens": 1}
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
    failures = {"left": 2}

    async def forward(request):
        if request.url.path == "/v1/cache/snapshot" and failures["left"] > 0:
            failures["left"] -= 1
            return Response(b"busy", 503)
        async with httpx.AsyncClient() as client:
            r = await client.get(worker.url + request.url.path, timeout=30)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    url, server = serve_in_thread(Starlette(routes=[Route("/{path:path}", forward)]), "the failing proxy")
    try:
        router = launch.router([url], "--kv-events", "redis", "--redis-url", launch.redis())

        def matched() -> int:
            explained = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
            return explained["candidates"][0]["matched_tokens"]

        wait_until(lambda: failures["left"] == 0, 15, what="both snapshots refused")
        wait_until(lambda: matched() > 0, 15, what="the worker's cache in the index")
        assert (
            matched() == httpx.post(router.url + "/debug/route", json=body).json()["prompt_tokens"] // 16 * 16
        )
    finally:
        server.should_exit = True


@pytest.mark.parametrize("mode", ["http", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_restarted_worker_is_re_synced_once(launch, mode):
    """A restart is seen twice (its event stream closes and reopens; its health reports a new
    epoch): the worker is re-synced from its snapshot once, whichever comes first."""
    if mode == "redis" and REDIS is None:
        pytest.skip("redis-server not installed")
    extra = ["--redis-url", launch.redis()] if mode == "redis" else []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["worker", "--engine", "sim", "--model", "sim-8b", "--advertise-url", url, *extra]
    worker = launch.module(*args, port=port)
    router = launch.router([url], "--kv-events", mode, "--health-interval-s", "0.2", *extra)
    resyncs = f'radixgate_upstream_kv_resyncs_total{{worker="{url}"}}'
    wait_until(lambda: metric(router.url, resyncs) >= 1, 30, what="the first sync")
    worker.proc.kill()
    worker.proc.wait()
    epoch = httpx.get(launch.module(*args, port=port).url + "/health", timeout=5).json()["epoch"]

    def seen() -> bool:
        (view,) = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        return view["epoch"] == epoch and metric(router.url, resyncs) >= 2

    wait_until(seen, 30, what="the restart seen and re-synced")
    time.sleep(1.0)  # NOTE: five health checks more, and the event stream's reconnection, come and go
    assert metric(router.url, resyncs) == 2
    body = {"model": "sim-8b", "prompt": "after the restart " * 8, "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_until(lambda: matched_tokens(router.url, body)[url] >= 128, 8, what="the new life's events")
