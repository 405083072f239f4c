"""Engine with the tiny model on CPU: cached, batched and chunked runs give the same greedy tokens;
stop strings; a small KV pool queues requests; aborts and failed forwards release every page."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.engine import HELD_OUTPUTS, Engine
from worker.sampling import SamplingParams

SHARED = "System: you are a terse assistant that answers in one line. Context: " * 3  # ~210 tokens


def make_engine(**overrides) -> Engine:
    cfg = WorkerConfig(**{"model": "tiny", "device": "cpu", "kv_cache_tokens": 8192, **overrides})
    engine = build_engine(cfg)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.stop()


async def generate(engine: Engine, prompt: str, max_tokens: int = 8, **params):
    """(text, token ids, last output) of one greedy request."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    handle = engine.submit(engine.tokenizer.encode_prompt(prompt), sp)
    text, tokens = [], []
    while True:
        out = await asyncio.wait_for(handle.outputs.get(), 60)
        assert out.error is None, out.error
        text.append(out.text)
        tokens += out.token_ids
        if out.finish_reason is not None:
            return "".join(text), tokens, out


async def idle(engine: Engine, deadline_s: float = 10.0) -> None:
    """Wait until no request holds a page; assert nothing leaked."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        snap = engine.snapshot()
        if snap.running == 0 and snap.waiting == 0 and snap.kv_pages_active == 0:
            break
        await asyncio.sleep(0.01)
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.kv_pages_active) == (0, 0, 0)
    assert snap.kv_pages_free + snap.kv_pages_cached == snap.kv_pages_total


async def test_cached_prefix_gives_the_same_greedy_tokens(engine):
    await engine.flush_cache()
    question = SHARED + "Question: what is the capital of France?"
    _, cold, out_cold = await generate(engine, question, 12)
    assert out_cold.cached_tokens == 0
    await engine.flush_cache()
    await generate(engine, SHARED + "Question: unrelated warm-up", 2)
    _, warm, out_warm = await generate(engine, question, 12)
    assert out_warm.cached_tokens >= 192  # the shared system prompt's full pages
    assert warm == cold
    await idle(engine)


async def test_batch_gives_the_same_tokens_as_one_by_one(engine):
    prompts = [f"Request {i}: {'abc' * (i + 3)} tell me more" for i in range(5)]
    await engine.flush_cache()
    alone = [(await generate(engine, p, 10))[1] for p in prompts]
    await engine.flush_cache()
    together = await asyncio.gather(*(generate(engine, p, 10) for p in prompts))
    assert [t[1] for t in together] == alone
    await idle(engine)


async def test_chunked_prefill_gives_the_same_tokens():
    chunked = make_engine(chunked_prefill_tokens=32)
    try:
        prompt = SHARED + "Question: and Germany?"
        _, tokens, out = await generate(chunked, prompt, 10)
        assert chunked.scheduler.stats.prefill_tokens == out.prompt_tokens
    finally:
        chunked.stop()
    whole = make_engine(chunked_prefill_tokens=4096)
    try:
        assert (await generate(whole, prompt, 10))[1] == tokens
    finally:
        whole.stop()


async def test_stop_string_and_max_tokens(engine):
    prompt = "Stop strings end the text: "
    text, _, out = await generate(engine, prompt, 20)
    assert out.finish_reason == "length" and out.completion_tokens == 20
    stop = text[5:7]
    assert stop and stop in text
    cut, _, out = await generate(engine, prompt, 20, stop=[stop])
    assert out.finish_reason == "stop"
    assert cut == text[: text.index(stop)]
    # vLLM's include_stop_str_in_output: the stop string found first ends the text, beside a longer
    # one from the same place and one from a later place
    at = text.index(stop)
    longer, later = text[at : at + 3], text[at + 1 : at + 3]
    for stops in ([stop], [longer, stop], [later, stop]):
        kept, _, out = await generate(engine, prompt, 20, stop=stops, include_stop_str_in_output=True)
        assert out.finish_reason == "stop" and kept == text[: at + 2], stops
    await idle(engine)


async def test_small_kv_pool_queues_requests_and_all_complete():
    # 16 pages of 16 tokens; each request may need 80 + 60 tokens = 9 pages.
    small = make_engine(kv_cache_tokens=256, decode_reserve_tokens=8)
    try:
        prompts = [f"{i:02d} " + "x" * 77 for i in range(6)]
        results = await asyncio.gather(*(generate(small, p, 60, ignore_eos=True) for p in prompts))
        assert all(out.finish_reason == "length" and out.completion_tokens == 60 for _, _, out in results)
        assert small.snapshot().finished.get("length") == 6
        await idle(small)
    finally:
        small.stop()


async def test_abort_releases_pages(engine):
    sp = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    handle = engine.submit(engine.tokenizer.encode_prompt(SHARED + "a long answer please"), sp)
    await asyncio.wait_for(handle.outputs.get(), 30)  # it is decoding now
    assert engine.snapshot().kv_pages_active > 0
    engine.abort(handle.rid)
    await idle(engine)
    assert engine.snapshot().finished.get("abort", 0) >= 1


async def test_failed_forward_fails_its_requests_and_the_engine_keeps_serving(engine):
    # NOTE: the warm-up's forward must not be the one that fails (a fresh engine may still run it)
    assert await asyncio.to_thread(engine.ready.wait, 60)
    model = engine.executor.model
    real = model.forward
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device error")
        return real(*args)

    model.forward = flaky
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4)
        handle = engine.submit(engine.tokenizer.encode_prompt("this one fails"), sp)
        out = await asyncio.wait_for(handle.outputs.get(), 30)
        assert out.finish_reason == "error" and out.error_status == 500
        _, _, ok = await generate(engine, "this one works", 4)
        assert ok.finish_reason == "length"
    finally:
        model.forward = real
    await idle(engine)


async def test_a_huge_integer_temperature_does_not_fail_the_requests_in_its_step(engine):
    """temperature 2**63 (a JSON integer, validated as the server does) in one extend step with
    greedy and integer-temperature requests: every request of the step finishes."""
    release = threading.Event()
    # NOTE: the engine thread waits in this call, so the requests below are added in one drain
    # (prompts shorter than a page: none waits for another to compute a shared page)
    held = asyncio.ensure_future(engine.call(lambda: release.wait(30)))
    handles = [
        engine.submit(
            engine.tokenizer.encode_prompt(f"step mate {i}"),
            SamplingParams(temperature=t, max_tokens=3, seed=i).validate(),
        )
        for i, t in enumerate([2**63, 0, 1, 2])
    ]
    release.set()
    assert await held is True
    for handle in handles:
        while (out := await asyncio.wait_for(handle.outputs.get(), 30)).finish_reason is None:
            pass
        assert out.error is None and out.finish_reason == "length"
    await idle(engine)


async def test_a_request_the_engine_took_counts_against_the_queue_until_its_snapshot_shows_it():
    """submit checks the last snapshot's waiting count plus the requests submitted since: one the
    engine thread took but no snapshot shows yet still counts, so the next is refused at once (a
    429 the engine thread would give later, when it finds the queue full)."""
    from worker.request import QueueFullError

    small = make_engine(max_running=1, max_waiting=1)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        running = small.submit(small.tokenizer.encode_prompt("keeps the only slot"), greedy)
        await asyncio.wait_for(running.outputs.get(), 30)  # decoding: the next request must wait
        # NOTE: the engine thread waits in a first call while `waiting` and a second call queue up
        # behind it, so it takes both in one pass of its inbox: `waiting` joins the queue, then the
        # second call holds the thread before its snapshot shows that
        first, go = threading.Event(), threading.Event()
        gate = asyncio.ensure_future(small.call(lambda: first.set() or go.wait(30)))
        assert await asyncio.to_thread(first.wait, 30)
        waiting = small.submit(small.tokenizer.encode_prompt("waits"), greedy)
        entered, release = threading.Event(), threading.Event()
        held = asyncio.ensure_future(small.call(lambda: entered.set() or release.wait(30)))
        await asyncio.sleep(0)  # NOTE: call() puts its message in the inbox when its task first runs
        go.set()
        assert await gate is True
        assert await asyncio.to_thread(entered.wait, 30)
        assert small.snapshot().waiting == 1  # taken, not in a snapshot yet: counted all the same
        with pytest.raises(QueueFullError, match="the waiting queue is full"):
            small.submit(small.tokenizer.encode_prompt("refused at once"), greedy)
        release.set()
        assert await held is True
        small.abort(running.rid)
        small.abort(waiting.rid)
        await idle(small)
    finally:
        small.stop()


async def test_a_call_cancelled_before_it_runs_is_skipped_and_the_engine_lives_on(engine):
    import threading

    release, ran = threading.Event(), []
    blocker = asyncio.ensure_future(engine.call(lambda: release.wait(10)))  # holds the engine thread
    await asyncio.sleep(0.05)
    cancelled = asyncio.ensure_future(engine.call(lambda: ran.append(1)))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.sleep(0.05)  # NOTE: the cancel reaches the engine's future in a loop callback
    release.set()
    assert await blocker is True
    assert await engine.call(lambda: "still here") == "still here" and engine.alive
    assert ran == [] and cancelled.cancelled()
    _, _, out = await generate(engine, "after a cancelled call", 2)
    assert out.finish_reason == "length"


async def test_a_held_answer_reaches_its_reader_whole_when_it_finishes(engine):
    """A non-streamed answer (hold) wakes its reader once, when it finishes, not once a step: its
    outputs stay with the engine until then, and are the same as a streamed twin's."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = engine.tokenizer.encode_prompt(SHARED + "held or streamed")
    streamed, held = engine.submit(prompt, sp), engine.submit(prompt, sp, hold=True)
    seen = []
    while len(seen) < 3:
        seen.append(await asyncio.wait_for(streamed.outputs.get(), 60))
    assert seen[-1].finish_reason is None and held.outputs.empty()  # same steps: 3 outputs each by now
    while seen[-1].finish_reason is None:
        seen.append(await asyncio.wait_for(streamed.outputs.get(), 60))
    whole = [await asyncio.wait_for(held.outputs.get(), 60) for _ in range(len(seen))]
    assert [o.token_ids for o in whole] == [o.token_ids for o in seen] and whole[-1].finish_reason == "length"
    assert held.outputs.empty()
    await idle(engine)


async def test_a_held_answer_comes_a_batch_of_outputs_at_a_time(engine):
    """A long whole answer is not kept whole by the engine: its outputs come HELD_OUTPUTS at a time."""
    sp = SamplingParams(temperature=0.0, max_tokens=HELD_OUTPUTS + 8, ignore_eos=True)
    prompt = engine.tokenizer.encode_prompt(SHARED + "a long held answer")
    streamed, held = engine.submit(prompt, sp), engine.submit(prompt, sp, hold=True)
    for _ in range(HELD_OUTPUTS + 2):  # NOTE: the twins' outputs of a step reach their queues together
        assert (await asyncio.wait_for(streamed.outputs.get(), 60)).finish_reason is None
    assert held.outputs.qsize() == HELD_OUTPUTS
    await idle(engine)
