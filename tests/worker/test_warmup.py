"""The warm-up request a worker runs before serving: it goes through the real forward (prefill and
decode), /health says "starting" (503) until it is over, a request sent meanwhile waits and is
served, and it leaves no trace: no cached pages, no KV events, no counted tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from router.kv_events import decode
from tests.worker.test_server import LiveServer
from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.sampling import SamplingParams

WARMUP_TOKENS = 40
WARMUP_IDS = [1 + i % 200 for i in range(WARMUP_TOKENS)]  # what Engine._warmup sends


class GatedExecutor:
    """The engine's real executor; each step first waits for ``gate`` and is recorded."""

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.steps = inner, threading.Event(), []

    def run(self, batch):
        assert self.gate.wait(30), "the test never opened the gate"
        self.steps.append((batch.mode, batch.num_new_tokens))
        return self.inner.run(batch)


def gated_engine(**overrides) -> tuple[Engine, GatedExecutor]:
    cfg = WorkerConfig(**{"model": "tiny", "device": "cpu", "kv_cache_tokens": 4096,
                          "warmup_tokens": WARMUP_TOKENS, **overrides})  # fmt: skip
    engine = build_engine(cfg)
    engine.executor = gated = GatedExecutor(engine.executor)
    return engine, gated


async def collect(engine: Engine, ids: list[int], max_tokens: int = 3):
    handle = engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while True:
        out = await asyncio.wait_for(handle.outputs.get(), 60)
        assert out.error is None, out.error
        if out.finish_reason is not None:
            return out


async def test_warmup_runs_the_forward_then_leaves_no_trace():
    engine, gated = gated_engine()
    events = engine.publisher.subscribe()
    engine.start()
    try:
        await asyncio.sleep(0.2)
        assert not engine.ready.is_set()  # held at the gate, inside the warm-up's prefill
        early = asyncio.create_task(collect(engine, WARMUP_IDS))  # the same prompt, sent meanwhile
        await asyncio.sleep(0.1)
        assert not early.done()
        gated.gate.set()
        out = await early
        assert engine.ready.is_set()
        # the warm-up: one prefill of its prompt, then a decode step per further output token
        assert gated.steps[:4] == [("extend", WARMUP_TOKENS), ("decode", 1), ("decode", 1), ("decode", 1)]
        # then the request, with nothing cached from the identical warm-up prompt
        assert gated.steps[4:] == [("extend", WARMUP_TOKENS), ("decode", 1), ("decode", 1)]
        assert out.cached_tokens == 0 and out.completion_tokens == 3
        snap = engine.snapshot()
        assert snap.prompt_tokens == WARMUP_TOKENS and snap.prefill_tokens == WARMUP_TOKENS
        assert snap.decode_tokens == 2 and snap.cached_tokens == 0
        assert snap.kv_pages_cached == WARMUP_TOKENS // 16  # the request's own full pages only
        # KV events: seq 0 announces an empty cache; the next batch stores only the request's pages
        first = decode(await asyncio.wait_for(events.queue.get(), 10))
        assert first.seq == 0 and first.cleared and not first.stored and not first.removed
        second = decode(await asyncio.wait_for(events.queue.get(), 10))
        assert not second.cleared and not second.removed
        assert sum(len(s.block_hashes) for s in second.stored) == WARMUP_TOKENS // 16
    finally:
        gated.gate.set()
        engine.stop()


def test_health_is_503_starting_until_the_warmup_is_over():
    engine, gated = gated_engine()
    with LiveServer(engine) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        starting = client.get("/health")
        assert starting.status_code == 503 and starting.json()["status"] == "starting"
        gated.gate.set()
        deadline = time.monotonic() + 30
        while (resp := client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.02)
        body = resp.json()
        assert body["status"] == "ok" and body["kv_pages_free"] == body["kv_pages_total"]
        assert client.get("/v1/cache/info").status_code == 200


def test_warmup_off_means_ready_at_start():
    engine, gated = gated_engine(warmup_tokens=0)
    gated.gate.set()
    engine.start()
    try:
        assert engine.ready.wait(10)
        assert gated.steps == []  # no forward ran
    finally:
        engine.stop()
