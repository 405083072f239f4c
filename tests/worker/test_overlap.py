"""Overlapped scheduling: the decode step after a running one is scheduled and launched before the
running one's tokens are back (Scheduler.schedule_ahead, Engine with --overlap-schedule on). The
tokens, finish reasons and pages must be exactly those of one step at a time."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import numpy as np
import pytest
import torch

from tests.worker.test_engine import SHARED, idle
from tests.worker.test_scheduler import (
    ToyModel,
    abort_at_random,
    assert_no_leak,
    assert_pages_accounted,
    make,
    prefix_sharing_prompt,
    prompt,
    reference,
)
from worker import scheduler
from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.engine_api import chainable_step
from worker.guided import requested_grammar
from worker.request import Request, ScheduledBatch
from worker.sampling import SamplingParams
from worker.scheduler import Scheduler
from worker.sim_engine import build_sim_engine


def launch(model: ToyModel, batch: ScheduledBatch, before: tuple[ScheduledBatch, list] | None) -> list:
    """The toy device runs steps in launch order; a step scheduled ahead reads its input tokens
    from the step before's sampled tokens (``before``: that step and the toy's output), as the
    executor does on the device."""
    if batch.inputs_from is not None:
        assert before is not None
        prev, out = before
        sampled = [t for t, s in zip(out, prev.sample, strict=True) if s]
        for i, f in enumerate(batch.inputs_from):
            if f >= 0:
                batch.input_ids[i] = sampled[f]
    return model.forward(batch)


def run_overlapped(sched: Scheduler, model: ToyModel, on_step=None, max_steps: int = 10_000) -> int:
    """Drive ``sched`` as the engine does with overlap: launch, schedule ahead, commit; returns
    the steps run."""
    running: tuple[ScheduledBatch, list] | None = None
    steps = 0
    while sched.has_work() or running is not None:
        if running is None:
            batch = sched.schedule()
            if batch is None:
                if on_step is not None:
                    on_step()
                continue
            running = (batch, launch(model, batch, None))
        batch, out = running
        running = None
        ahead = sched.schedule_ahead(batch)
        if ahead is not None:
            running = (ahead, launch(model, ahead, (batch, out)))
        for req in sched.commit(batch, out):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
        steps += 1
        assert steps < max_steps
        if on_step is not None:
            on_step()
    return steps


def test_a_step_ahead_decodes_one_position_further_with_the_step_befores_tokens():
    sched, model = make()
    a, b = Request("a", prompt(1, 9), max_tokens=5), Request("b", prompt(2, 6), max_tokens=2)
    for r in (a, b):
        sched.add(r)
    first = sched.schedule()
    assert first.mode == "extend"
    # after an extend step comes a decode step of what it prefilled: its first tokens, on the device
    decode = sched.schedule_ahead(first)
    assert decode.mode == "decode" and decode.requests == [a, b] and decode.inputs_from.tolist() == [0, 1]
    assert decode.starts == [9, 6] and decode.ends == [10, 7] and decode.input_ids.tolist() == [0, 0]
    sched.commit(first, model.forward(first))
    ahead = sched.schedule_ahead(decode)
    # b gets its 2nd and last token from ``decode``: only a decodes ahead, at the next position
    assert ahead is not None and ahead.requests == [a] and ahead.inputs_from.tolist() == [0]
    assert ahead.starts == [10] and ahead.ends == [11] and ahead.positions.tolist() == [10]
    assert ahead.kv_indices.tolist() == a.slots[:11].tolist() and ahead.out_slots.tolist() == [a.slots[10]]
    assert sched.stats.ahead_steps == 2


def test_only_an_extend_step_that_scores_its_prompt_is_not_chainable():
    """Prompt logprobs are read back as the extend step runs; the request's decode steps chain."""
    sched, model = make()
    scoring = Request("a", prompt(1, 9), max_tokens=4, full_prefill=True)
    sched.add(scoring)
    sched.add(Request("b", prompt(2, 6), max_tokens=4))
    for r in sched.waiting:
        r.payload = types.SimpleNamespace(params=SamplingParams())
    extend = sched.schedule()
    assert extend.mode == "extend" and scoring in extend.requests and not chainable_step(extend)
    sched.commit(extend, model.forward(extend))
    decode = sched.schedule()
    assert decode.mode == "decode" and scoring in decode.requests and chainable_step(decode)
    plain = sched.schedule_ahead(decode)
    assert plain is not None and chainable_step(plain)
    extend.requests = [r for r in extend.requests if not r.full_prefill]
    assert chainable_step(extend)


def test_nothing_is_scheduled_ahead_while_a_request_waits_or_prefills():
    sched, model = make(chunked_prefill_tokens=4)
    sched.add(Request("a", prompt(1, 5), max_tokens=8))
    while not sched.running:
        step = sched.schedule()
        sched.commit(step, model.forward(step))
    decode = sched.schedule()
    assert decode.mode == "decode"
    sched.add(Request("b", prompt(2, 12), max_tokens=4))
    assert sched.schedule_ahead(decode) is None  # NOTE: the next step admits b (an extend)
    sched.commit(decode, model.forward(decode))
    step = sched.schedule()
    assert step.mode == "extend"
    sched.commit(step, model.forward(step))
    assert sched.prefilling  # b's prompt is 3 chunks
    decode = sched.schedule()
    assert decode.mode == "decode" and sched.schedule_ahead(decode) is None


def test_waiting_requests_stop_the_chain_only_while_a_slot_can_take_them():
    sched, model = make(max_running=2)
    a, b = Request("a", prompt(1, 9), max_tokens=6), Request("b", prompt(2, 6), max_tokens=3)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.commit(step, model.forward(step))
    sched.add(Request("c", prompt(3, 7), max_tokens=4))  # NOTE: waits: both slots are taken
    decode = sched.schedule()
    assert decode.mode == "decode" and sched.waiting
    ahead = sched.schedule_ahead(decode)
    assert ahead is not None and ahead.requests == [a, b]  # every slot stays taken: c cannot start
    sched.commit(decode, model.forward(decode))
    # b's 3rd and last token comes from ``ahead``: a slot frees for c then, so nothing is chained
    assert sched.schedule_ahead(ahead) is None


def test_a_request_waiting_for_pages_lets_the_chain_go_on_until_pages_or_the_queue_change():
    """Pool-limited saturation: admission failed for lack of pages, and nothing changes that until a
    request ends (or another arrives), so decode steps are chained meanwhile, admission retried at
    least every MAX_CHAIN_BLOCKED steps; once b ends, the next step admits the waiting request."""
    sched, model = make(num_pages=40, decode_reserve_tokens=8)  # 160 slots
    a, b = Request("a", prompt(1, 14), max_tokens=60), Request("b", prompt(2, 60), max_tokens=24)
    for r in (a, b):
        sched.add(r)
    while len(sched.running) < 2:
        step = sched.schedule()
        sched.commit(step, model.forward(step))
    big = Request("c", prompt(3, 80), max_tokens=8)  # 80 + reserve: more pages than are left while b runs
    sched.add(big)

    def chain(step: ScheduledBatch) -> int:
        """Run ``step`` and the steps chained after it (as the engine does); how many were chained."""
        chained, out = 0, model.forward(step)
        while True:
            ahead = sched.schedule_ahead(step)
            ahead_out = None if ahead is None else launch(model, ahead, (step, out))
            for req in sched.commit(step, out):
                if req.finish_reason is not None:
                    sched.finish(req, req.finish_reason)
            if ahead is None:
                return chained
            chained, step, out = chained + 1, ahead, ahead_out

    chains = []
    while True:
        step = sched.schedule()
        if step.mode == "extend":
            break
        chains.append(chain(step))
    assert step.requests == [big] and b.finish_reason == "length" and a.finish_reason is None
    # the first decode step (right after the prefill) does not try admission; each one after does,
    # then chains the cap's worth of steps, until b's last token frees its pages
    assert chains[0] == 0 and set(chains[1:-1]) == {scheduler.MAX_CHAIN_BLOCKED}, chains
    assert chains[-1] < scheduler.MAX_CHAIN_BLOCKED


def test_a_step_ahead_is_not_scheduled_when_its_pages_would_need_a_retraction():
    sched, model = make(num_pages=6, decode_reserve_tokens=0)  # 24 slots
    sched.add(Request("a", prompt(1, 11), max_tokens=40))
    sched.add(Request("b", prompt(2, 11), max_tokens=40))
    steps = 0
    while sched.running or sched.prefilling or sched.waiting:
        batch = sched.schedule()
        if (
            batch.mode == "decode"
            and sched.allocator.num_free == 0
            and any(r.kv_len + 1 >= r.pages.size * 4 for r in batch.requests)
        ):
            assert sched.schedule_ahead(batch) is None
            return
        for req in sched.commit(batch, model.forward(batch)):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
        steps += 1
        assert steps < 200
    pytest.fail("the pool never ran full")


@pytest.mark.parametrize("seed", range(30))
def test_overlapped_steps_give_the_tokens_and_pages_of_one_step_at_a_time(seed):
    """Random prompts sharing prefixes, EOS ids, max_tokens, chunked prefills, aborts between steps
    and a small pool: every request's tokens are the reference's up to where it ended, and no page
    leaks."""
    rng = np.random.default_rng(seed)
    sched, model = make(num_pages=32, decode_reserve_tokens=int(rng.integers(0, 8)), max_running=6,
                        chunked_prefill_tokens=int(rng.choice([4, 10, 2048])))  # fmt: skip
    reqs = []
    for i in range(8):
        p = prefix_sharing_prompt(rng, 30)
        stop = frozenset(int(t) for t in rng.integers(0, 200, int(rng.integers(0, 4))))
        reqs.append(Request(str(i), p, max_tokens=int(rng.integers(1, 40)), stop_token_ids=stop))
    pending, aborted = list(reqs), set()

    def between_steps() -> None:  # NOTE: what the engine's inbox does while a step may be in flight
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())
        abort_at_random(sched, rng, 0.02, aborted)
        assert_pages_accounted(sched, 32)

    while pending:
        sched.add(pending.pop())
        run_overlapped(sched, model, between_steps)
    assert_no_leak(sched)
    assert sched.stats.ahead_steps > 0
    for req in reqs:
        if req.rid in aborted:
            continue
        want = reference(req.prompt_ids, req.max_tokens)
        ends = [i for i, t in enumerate(want) if t in req.stop_token_ids]
        if ends:
            want = want[: ends[0] + 1]
        assert req.output_ids == want
        assert req.finish_reason == ("stop" if ends else "length")


# ---------------------------------------------------------------------------- engines


def model_engine(overlap: str, **overrides) -> Engine:
    cfg = WorkerConfig(
        model="tiny", device="cpu", kv_cache_tokens=4096, overlap_schedule=overlap, **overrides
    )
    engine = build_engine(cfg)
    engine.start()
    return engine


async def run_requests(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list[tuple]:
    """(text, token ids, finish reason, logprobs) of requests sent together."""

    async def one(text: str, sp: SamplingParams) -> tuple:
        handle = engine.submit(engine.tokenizer.encode_prompt(text), sp)
        chunks, tokens, logprobs = [], [], []
        while True:
            out = await asyncio.wait_for(handle.outputs.get(), 120)
            assert out.error is None, out.error
            chunks.append(out.text)
            tokens += out.token_ids
            logprobs.append(out.logprobs)
            if out.finish_reason is not None:
                return "".join(chunks), tokens, out.finish_reason, logprobs

    return await asyncio.gather(*(one(t, sp) for t, sp in requests))


class Watched:
    """A request's grammar matcher that keeps the tokens fed to it and counts the masks asked of it."""

    def __init__(self, matcher) -> None:
        self.matcher, self.masks, self.fed = matcher, 0, []

    def unsafe_compute_mask_ptr(self, *args):
        self.masks += 1
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def consume_token(self, token: int):
        self.fed.append(token)
        return self.matcher.consume_token(token)

    def __getattr__(self, name: str):
        return getattr(self.matcher, name)


class Recorded:
    """A grammar's template that keeps every matcher made from it (one per request), watched."""

    def __init__(self, template, made: list) -> None:
        self.template, self.made = template, made

    def deep_copy(self) -> Watched:
        self.made.append(Watched(self.template.deep_copy()))
        return self.made[-1]


def mixed_requests(
    stop_text: str, stop_id: int, engine: Engine, made: list
) -> list[tuple[str, SamplingParams]]:
    def guide(body: dict):
        compiled = engine.guides.compile(*requested_grammar(body))
        return dataclasses.replace(compiled, template=Recorded(compiled.template, made))

    json_object = guide({"response_format": {"type": "json_object"}})
    choice = guide({"guided_choice": ["left", "right", "straight on"]})
    return [
        (SHARED + "one", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        (SHARED + "two", SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
        # NOTE: top-p beside a top-k row: on the kernels a threshold kernel and a k-th score cut, no sort
        (SHARED + "three", SamplingParams(temperature=0.8, seed=5, top_p=0.9, max_tokens=30, ignore_eos=True)),
        (SHARED + "four", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text])),
        (SHARED + "five", SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id])),
        (SHARED + "six", SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)),
        # NOTE: penalties over a history whose newest token is on the device in a chained step
        (SHARED + "seven", SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=1.5,
                                          presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True)),
        (SHARED + "eight", SamplingParams(temperature=0.9, seed=2, top_k=20, max_tokens=30, frequency_penalty=-1.0,
                                          logit_bias={stop_id: -3.0}, ignore_eos=True)),
        # NOTE: the stop id wins every step that min_tokens allows it: the 10th token ends the request
        (SHARED + "nine", SamplingParams(temperature=0.0, max_tokens=30, min_tokens=9,
                                         stop_token_ids=[stop_id], logit_bias={stop_id: 100.0})),
        # NOTE: grammars: a chained step's masks wait for the step before's tokens; a choice ends
        # (EOS) while a step is ahead of it
        (SHARED + "ten", SamplingParams(temperature=0.0, max_tokens=50, guide=json_object)),
        (SHARED + "eleven", SamplingParams(temperature=1.0, seed=8, max_tokens=50, guide=json_object,
                                           frequency_penalty=0.7, logprobs=1)),
        (SHARED + "twelve", SamplingParams(temperature=0.0, max_tokens=50, guide=choice)),
        # NOTE: its prefill scores the prompt (one step at a time); its decode steps chain
        (SHARED + "thirteen", SamplingParams(temperature=0.0, max_tokens=25, prompt_logprobs=1, ignore_eos=True)),
    ]  # fmt: skip


async def test_the_model_engine_gives_the_same_outputs_with_and_without_overlap():
    """Greedy and seeded requests, a stop string and a stop id that end requests while a step is
    ahead of them, max_tokens, a logprobs request (read back with its step's tokens), penalties,
    bias and min_tokens (their newest token is on the device when a step is ahead), and grammars
    (a chained step's masks wait for the step before's tokens)."""
    off = model_engine("off")
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40)
        (text, _, _, _), (_, tokens, _, _) = await run_requests(
            off, [(SHARED + "four", greedy), (SHARED + "five", greedy)]
        )
        stop_text = text[len(text) // 2 : len(text) // 2 + 2]
        stop_id = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
        made_off: list = []
        want = await run_requests(off, mixed_requests(stop_text, stop_id, off, made_off))
        await idle(off)
        assert off.scheduler.stats.ahead_steps == 0
    finally:
        off.stop()
    assert want[3][2] == "stop" and want[4][2] == "stop"  # NOTE: both stops happen mid-decode
    assert want[8][2] == "stop" and len(want[8][1]) == 10 and want[8][1][-1] == stop_id
    assert want[11][0] in ("left", "right", "straight on") and want[11][2] == "stop"
    on = model_engine("on")
    try:
        made: list = []
        got = await run_requests(on, mixed_requests(stop_text, stop_id, on, made))
        await idle(on)
        assert on.scheduler.stats.ahead_steps > 0
    finally:
        on.stop()
    assert [g[:3] for g in got] == [w[:3] for w in want]  # text, token ids, finish reason
    # NOTE: each grammar got one mask and one token per token of its answer, none for a row scheduled
    # ahead of its request's end
    for matchers, results in ((made_off, want), (made, got)):
        assert sorted((m.fed, m.masks) for m in matchers) == sorted((r[1], len(r[1])) for r in results[9:12])
    assert made[2].is_stopped() and not any(m.is_error() for m in made)
    # NOTE: logprobs agree to float rounding (which requests share a step depends on arrival timing)
    for g, w in zip(got[5][3], want[5][3], strict=True):
        assert g[1] == w[1] and (g[0], *g[2]) == pytest.approx((w[0], *w[2]), abs=1e-4)


async def test_interleaved_adapters_chain_and_answer_as_one_step_at_a_time():
    """Decode steps put each LoRA adapter's requests side by side (worker.request.build_batch); a step
    scheduled ahead takes each row's input from the step before's sampled tokens through that order
    (inputs_from): the outputs are the same with and without overlap."""
    from tests.kernels.test_model_kernels import random_adapters
    from worker.model.lora import add_adapter

    def params(adapter: int, **kw) -> SamplingParams:
        return SamplingParams(
            **({"temperature": 0.0, "max_tokens": 20, "ignore_eos": True} | kw), adapter=adapter
        )

    requests = [(SHARED + "a", params(2)), (SHARED + "b", params(1, max_tokens=13)), (SHARED + "c", params(0)),
                (SHARED + "d", params(2, temperature=0.8, seed=5)), (SHARED + "e", params(1))]  # fmt: skip
    results = {}
    for overlap in ("off", "on"):
        engine = model_engine(overlap, max_loras=2, max_lora_rank=6)
        try:
            for adapter in random_adapters(engine.executor.model):
                add_adapter(engine, adapter)
            results[overlap] = [r[:3] for r in await run_requests(engine, requests)]
            await idle(engine)
            results[overlap + "_ahead"] = engine.scheduler.stats.ahead_steps
        finally:
            engine.stop()
    assert results["on"] == results["off"]
    assert [len(r[1]) for r in results["on"]] == [20, 13, 20, 20, 20]
    assert results["off_ahead"] == 0 and results["on_ahead"] > 0


async def test_penalties_in_chained_steps_count_the_newest_token_from_the_device():
    """Requests with penalties, bias and min_tokens and no grammar beside them: every chained step
    samples at launch, its rows' newest tokens still on the device (a grammar in the batch would
    defer the sampling until they are on the host)."""
    off = model_engine("off")
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40)
        ((_, tokens, _, _),) = await run_requests(off, [(SHARED + "five", greedy)])
        stop_id = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
        requests = mixed_requests("unused", stop_id, off, [])[6:9]  # NOTE: seven, eight, nine
        want = await run_requests(off, requests)
    finally:
        off.stop()
    on = model_engine("on")
    try:
        got = await run_requests(on, mixed_requests("unused", stop_id, on, [])[6:9])
        await idle(on)
        assert on.scheduler.stats.ahead_steps > 0
    finally:
        on.stop()
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert want[2][2] == "stop" and len(want[2][1]) == 10


async def test_requests_admitted_while_others_decode_get_the_same_tokens_with_and_without_overlap():
    """Each late request is prefilled beside decoding ones; the decode step after that extend is
    chained with its inputs from two places: the new request's first token on the device, the
    others' last tokens from the host. The first request, decoding beside every extend, scored its
    prompt and has penalties (a decode step with it chains all the same)."""

    async def staggered(engine: Engine) -> list[list[int]]:
        sp = [SamplingParams(temperature=0.0, max_tokens=24 - 3 * i, ignore_eos=True) for i in range(4)]
        sp[0] = dataclasses.replace(sp[0], prompt_logprobs=1, frequency_penalty=0.6)
        handles, tokens = [], [[] for _ in sp]
        for i, p in enumerate(sp):
            handles.append(engine.submit(engine.tokenizer.encode_prompt(f"{SHARED} late {i}"), p))
            for _ in range(3 if i < len(sp) - 1 else 0):  # NOTE: the earlier ones decode a few steps first
                tokens[0] += (await asyncio.wait_for(handles[0].outputs.get(), 60)).token_ids
        for i, h in enumerate(handles):
            while True:
                out = await asyncio.wait_for(h.outputs.get(), 60)
                assert out.error is None, out.error
                tokens[i] += out.token_ids
                if out.finish_reason is not None:
                    break
        await idle(engine)
        return tokens

    results = {}
    for overlap in ("off", "on"):
        engine = model_engine(overlap)
        try:
            results[overlap] = await staggered(engine)
            results[overlap + "_ahead"] = engine.scheduler.stats.ahead_steps
        finally:
            engine.stop()
    assert results["on"] == results["off"]
    assert [len(t) for t in results["on"]] == [24, 21, 18, 15]
    assert results["off_ahead"] == 0 and results["on_ahead"] > 0


async def test_an_abort_while_a_step_is_ahead_releases_every_page():
    engine = model_engine("on")
    try:
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        handle = engine.submit(engine.tokenizer.encode_prompt(SHARED + "abort me"), long)
        short = asyncio.ensure_future(
            run_requests(
                engine, [(SHARED + "keep", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))]
            )
        )
        for _ in range(8):  # NOTE: both decode together by now, steps chained
            await asyncio.wait_for(handle.outputs.get(), 60)
        engine.abort(handle.rid)
        ((_, tokens, reason, _),) = await short
        assert reason == "length" and len(tokens) == 30
        await idle(engine)
        assert engine.scheduler.stats.ahead_steps > 0
        assert engine.snapshot().finished.get("abort", 0) == 1
    finally:
        engine.stop()


async def test_a_failed_step_while_one_is_ahead_fails_its_requests_and_the_engine_serves_on():
    engine = model_engine("on")
    real = engine.executor.collect
    fail = threading.Event()

    def flaky(launched):
        if fail.is_set() and launched.chainable:  # NOTE: a decode step, with one launched behind it
            fail.clear()
            raise RuntimeError("simulated device error")
        return real(launched)

    engine.executor.collect = flaky
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        handles = [engine.submit(engine.tokenizer.encode_prompt(SHARED + w), sp) for w in ("x", "y")]
        for h in handles:  # NOTE: both decode from here on, in every step
            assert (await asyncio.wait_for(h.outputs.get(), 60)).finish_reason is None
        fail.set()
        for h in handles:
            while True:
                out = await asyncio.wait_for(h.outputs.get(), 60)
                if out.finish_reason is not None:
                    break
            assert out.finish_reason == "error" and out.error_status == 500
        engine.executor.collect = real
        ((_, tokens, reason, _),) = await run_requests(engine, [("after", sp)])
        assert reason == "length" and len(tokens) == 20
        await idle(engine)
    finally:
        engine.executor.collect = real
        engine.stop()


async def test_the_sim_engine_gives_the_same_tokens_with_and_without_overlap():
    """The cost model queues a chained step behind the running one, as a device does."""

    async def tokens(overlap: str) -> tuple[list, int]:
        cfg = WorkerConfig(engine="sim", sim_decode_base_ms=1.0, sim_prefill_ms_per_token=0.0,
                           overlap_schedule=overlap)  # fmt: skip
        engine = build_sim_engine(cfg)
        engine.start()
        try:
            sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 17)]
            choice = engine.guides.compile(*requested_grammar({"guided_choice": ["north", "south"]}))
            sp.append(SamplingParams(temperature=0.0, max_tokens=30, guide=choice))
            outs = await run_requests(engine, [(SHARED + str(i), p) for i, p in enumerate(sp)])
            await idle(engine)
            assert outs[3][0] in ("north", "south") and outs[3][2] == "stop"
            return [o[1] for o in outs], engine.scheduler.stats.ahead_steps
        finally:
            engine.stop()

    want, none = await tokens("off")
    got, ahead = await tokens("on")
    assert got == want and none == 0 and ahead > 0
    assert [len(t) for t in got[:3]] == [5, 30, 17]


async def run_when_decoding(engine: Engine, request: tuple[str, SamplingParams]) -> list[tuple]:
    """``request`` sent once the engine has decoded a few more tokens (others are decoding)."""
    start = engine.snapshot().decode_tokens
    while engine.snapshot().decode_tokens < start + 8:
        await asyncio.sleep(0.002)
    return await run_requests(engine, [request])


def launch_chained_steps_strictly(engine: Engine) -> None:
    """Make the engine's launch of a chained step (one after another: ``after``) raise on any
    host-device sync (CUDA only)."""
    real = engine.executor.launch

    def strict(batch, after=None):
        if after is None:
            return real(batch, after)
        torch.cuda.set_sync_debug_mode("error")  # NOTE: a host-device sync raises
        try:
            return real(batch, after)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.executor.launch = strict  # type: ignore[method-assign]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_overlap_on_the_gpu_gives_the_same_outputs_and_launches_without_a_device_sync():
    """Graphs, pinned mirrors used in turn, tokens copied on the device and an event per step: the
    outputs equal one step at a time, and launching a chained step (greedy and sampled rows,
    logprobs, penalties, bias and min_tokens, and the grammar masks of the step before it, queued
    then) never waits for the step before."""
    requests = [
        (SHARED + "a", SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)),
        (SHARED + "b", SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        (
            SHARED + "c",
            SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, max_tokens=40, ignore_eos=True),
        ),
        (SHARED + "d", SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True)),
        (SHARED + "e", SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=1.2, presence_penalty=0.4,
                                      repetition_penalty=1.3, logit_bias={7: 2.0}, min_tokens=12)),
    ]  # fmt: skip
    results = {}
    for overlap in ("off", "on"):
        engine = build_engine(
            WorkerConfig(model="tiny", device="cuda", kv_cache_tokens=8192, overlap_schedule=overlap)
        )
        json_object = engine.guides.compile(*requested_grammar({"response_format": {"type": "json_object"}}))
        guided = (SHARED + "f", SamplingParams(temperature=0.8, seed=1, max_tokens=40, guide=json_object))
        if overlap == "on":
            launch_chained_steps_strictly(engine)
        engine.start()
        try:
            # NOTE: the grammar apart: beside it every chained step's sampling would wait for the host
            # tokens, and the penalties' device-token path would go unchecked
            done = await run_requests(engine, requests) + await run_requests(engine, [guided])
            results[overlap] = [r[:3] for r in done]
            await idle(engine)
            results[overlap + "_ahead"] = engine.scheduler.stats.ahead_steps
            if overlap == "on":  # NOTE: a request admitted while others decode: inputs from host and device
                greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
                both = await asyncio.gather(
                    run_requests(engine, requests[:1]), run_when_decoding(engine, (SHARED + "late", greedy))
                )
                assert [len(r[0][1]) for r in both] == [48, 24]
                await idle(engine)
        finally:
            engine.stop()
    assert results["on"] == results["off"]
    assert results["off_ahead"] == 0 and results["on_ahead"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_lora_steps_on_the_gpu_replay_graphs_and_chain_without_a_device_sync():
    """Adapters loaded at runtime into room made at start-up (--max-loras): their decode steps replay
    the LoRA graphs, a chained one launches without waiting for the step before, and the outputs equal
    one step at a time."""
    from tests.kernels.test_model_kernels import random_adapters
    from worker.model.lora import add_adapter

    def params(adapter: int, **kw) -> SamplingParams:
        return SamplingParams(
            **({"temperature": 0.0, "max_tokens": 24, "ignore_eos": True} | kw), adapter=adapter
        )

    requests = [(SHARED + "a", params(1)), (SHARED + "b", params(2, max_tokens=17)), (SHARED + "c", params(0)),
                (SHARED + "d", params(2, temperature=0.8, seed=5, logprobs=2))]  # fmt: skip
    results = {}
    for overlap in ("off", "on"):
        engine = build_engine(WorkerConfig(model="tiny", device="cuda", kv_cache_tokens=8192, max_loras=2,
                                           max_lora_rank=6, overlap_schedule=overlap))  # fmt: skip
        for adapter in random_adapters(engine.executor.model):
            add_adapter(engine, adapter)
        assert engine.executor.decode_graphs.lora.current()  # NOTE: the adapters fit the room
        if overlap == "on":
            launch_chained_steps_strictly(engine)
        engine.start()
        try:
            results[overlap] = [r[:3] for r in await run_requests(engine, requests)]
            await idle(engine)
            results[overlap + "_graphs"] = engine.executor.graph_steps
            results[overlap + "_ahead"] = engine.scheduler.stats.ahead_steps
        finally:
            engine.stop()
    assert results["on"] == results["off"]
    assert [len(r[1]) for r in results["on"]] == [24, 17, 24, 24]
    assert results["off_graphs"] > 0 and results["on_graphs"] > 0  # every decode step had adapter rows
    assert results["off_ahead"] == 0 and results["on_ahead"] > 0
