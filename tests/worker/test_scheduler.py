"""Scheduler: the tokens a request sees through its KV slots are its own, whatever the cache, chunking,
batching or memory pressure; every page comes back; LPM order with an age bound; bounded queue."""

from __future__ import annotations

import numpy as np
import pytest

from tests.worker.test_host_cache import ToyKV
from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache
from worker.request import QueueFullError, Request, ScheduledBatch, SchedulerConfig
from worker.sampling import accept_greedy
from worker.scheduler import Scheduler

PS = 4


class ToyModel:
    """Stores each token id in its KV slot; the next token is a hash of the context read back
    through ``kv_indices``. A wrong slot, stale page or shared-page mix-up changes the output."""

    def __init__(self, num_pages: int, vocab: int = 200) -> None:
        self.kv = np.full(num_pages * PS, -1, dtype=np.int64)
        self.vocab = vocab

    @staticmethod
    def next_token(context: list[int], vocab: int = 200) -> int:
        h = 7
        for i, t in enumerate(context):
            h = (h * 31 + t * (i + 1)) % 1_000_003
        return h % vocab

    def forward(self, batch: ScheduledBatch) -> list:
        """Extend / decode: the next token per request. Verify: the drafts the toy agrees with
        plus its own next token (greedy acceptance), per request."""
        self.kv[batch.out_slots] = batch.input_ids  # K/V written for the new tokens
        out = []
        for i in range(len(batch.requests)):
            kv = batch.kv_indices[batch.kv_indptr[i] : batch.kv_indptr[i + 1]]
            new = batch.input_ids[batch.qo_indptr[i] : batch.qo_indptr[i + 1]]
            context = self.kv[kv].tolist()
            assert -1 not in context, "read a slot that was never written"
            if batch.mode == "verify":
                best = [self.next_token(context + new[: j + 1].tolist(), self.vocab) for j in range(new.size)]
                out.append(accept_greedy(best, batch.drafts[i]))
                continue
            if batch.mode == "extend":
                context += new.tolist()
            out.append(self.next_token(context, self.vocab))
        return out


def reference(prompt: list[int], n: int, vocab: int = 200) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(ToyModel.next_token(tokens, vocab))
    return tokens[len(prompt) :]


def make(num_pages: int = 64, host_pages: int = 0, vocab: int = 200, **cfg) -> tuple[Scheduler, ToyModel]:
    alloc = PageAllocator(num_pages)
    model = ToyModel(num_pages, vocab)
    host = ToyKV(host_pages, model.kv) if host_pages else None  # copies the toy KV, poisons what it leaves
    cache = RadixCache(alloc, PS, namespace="toy", host=host)
    return Scheduler(SchedulerConfig(page_size=PS, **cfg), alloc, cache), model


def run(sched: Scheduler, model: ToyModel, max_steps: int = 10_000) -> list[ScheduledBatch]:
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None, "work left but nothing scheduled"
        steps.append(batch)
        for req in sched.commit(batch, model.forward(batch)):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
        assert len(steps) < max_steps
    return steps


def assert_no_leak(sched: Scheduler) -> None:
    free, tree, owned = sched.pages_accounted()
    assert owned == 0
    assert free + tree == sched.allocator.num_pages
    assert sched.cache.protected_pages == 0
    sched.cache.check_invariants()


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 200, n).tolist()


def prefix_sharing_prompt(rng: np.random.Generator, longest_tail: int) -> list[int]:
    """Few distinct first pages, so random prompts share prefixes of varied length."""
    return [int(rng.integers(0, 3)), 1, 2, 3] + [
        int(rng.integers(0, 2)) for _ in range(int(rng.integers(1, longest_tail)))
    ]


def abort_at_random(sched: Scheduler, rng: np.random.Generator, p: float, aborted: set[str]) -> None:
    """With probability ``p``, abort a running request picked at random (its id into ``aborted``)."""
    if rng.random() < p and sched.running:
        victim = sched.running[int(rng.integers(0, len(sched.running)))]
        aborted.add(victim.rid)
        sched.abort(victim)


def assert_pages_accounted(sched: Scheduler, total: int) -> None:
    """Every page free, in the tree or owned by a request, and the tree consistent."""
    free, tree, owned = sched.pages_accounted()
    assert free + tree + owned == total
    sched.cache.check_invariants()


def test_cached_prefix_gives_the_same_tokens_and_counts_cached_tokens():
    sched, model = make()
    shared = prompt(1, 30)
    a = Request("a", [*shared, 5, 6, 7], max_tokens=6)
    sched.add(a)
    run(sched, model)
    b = Request("b", [*shared, 8, 9], max_tokens=6)
    sched.add(b)
    run(sched, model)
    assert a.output_ids == reference(a.prompt_ids, 6)
    assert b.output_ids == reference(b.prompt_ids, 6)
    assert a.cached_tokens == 0 and b.cached_tokens == 28  # 7 full pages of the shared 30 tokens
    assert sched.stats.cached_tokens == 28 and sched.stats.prompt_tokens == 33 + 32
    assert_no_leak(sched)


def test_batched_chunked_and_one_by_one_agree():
    prompts = [prompt(i, 10 + 7 * i) for i in range(6)]
    together, model = make(max_running=8)
    reqs = [Request(str(i), p, max_tokens=5) for i, p in enumerate(prompts)]
    for r in reqs:
        together.add(r)
    steps = run(together, model)
    assert max(len(s.requests) for s in steps if s.mode == "decode") > 1  # really batched
    chunked, model = make(chunked_prefill_tokens=8)
    creqs = [Request(str(i), p, max_tokens=5) for i, p in enumerate(prompts)]
    for r in creqs:
        chunked.add(r)
    csteps = run(chunked, model)
    assert max(s.num_new_tokens for s in csteps if s.mode == "extend") <= 8
    for r, c, p in zip(reqs, creqs, prompts, strict=False):
        assert r.output_ids == c.output_ids == reference(p, 5)
    assert_no_leak(together)
    assert_no_leak(chunked)


def test_same_new_prefix_in_one_round_is_computed_once():
    sched, model = make()
    shared = prompt(3, 40)
    a, b = Request("a", [*shared, 1], max_tokens=2), Request("b", [*shared, 2], max_tokens=2)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.requests == [a]  # b would recompute a's pages: it waits one step
    for req in sched.commit(first, model.forward(first)):
        assert req.finish_reason is None
    run(sched, model)
    assert b.cached_tokens == 40
    assert sched.stats.prefill_tokens == 41 + 1  # b computed only its last token
    assert b.output_ids == reference(b.prompt_ids, 2)
    assert_no_leak(sched)


def test_small_kv_pool_queues_requests_and_all_complete():
    # 12 pages = 48 tokens; each request needs up to 12 + 24 = 36 tokens (9 pages).
    sched, model = make(num_pages=12, decode_reserve_tokens=2)
    reqs = [Request(str(i), prompt(10 + i, 12), max_tokens=24) for i in range(8)]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_ids == reference(r.prompt_ids, 24)
    assert sched.stats.retractions > 0  # the small reserve forced preemption, and it was correct
    assert_no_leak(sched)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "running"])
def test_abort_at_any_stage_releases_every_page(stage):
    sched, model = make(chunked_prefill_tokens=8)
    victim = Request("v", prompt(5, 30), max_tokens=50)
    other = Request("o", prompt(6, 9), max_tokens=50)
    sched.add(other)
    sched.add(victim)
    while True:
        in_stage = {"waiting": sched.waiting, "prefilling": sched.prefilling, "running": sched.running}
        if victim in in_stage[stage]:
            break
        batch = sched.schedule()
        sched.commit(batch, model.forward(batch))
    sched.abort(victim)
    sched.abort(other)
    assert victim.finish_reason == "abort" and not sched.has_work()
    assert_no_leak(sched)


def test_failed_step_releases_its_requests():
    sched, _ = make()
    reqs = [Request(str(i), prompt(i, 13), max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    failed = sched.fail(sched.schedule())
    assert set(failed) == set(reqs) and all(r.finish_reason == "error" for r in reqs)
    assert not sched.has_work()
    assert_no_leak(sched)


def test_lpm_prefers_cached_prefix_but_old_requests_go_first():
    sched, model = make(max_running=1, max_wait_s=10.0)
    shared = prompt(7, 32)
    sched.add(Request("warm", [*shared, 1], max_tokens=1))
    run(sched, model)
    cold = Request("cold", prompt(8, 20), max_tokens=1, arrival=100.0)
    hit = Request("hit", [*shared, 2], max_tokens=1, arrival=101.0)
    sched.add(cold)
    sched.add(hit)
    assert sched.schedule(now=102.0).requests == [hit]  # longest prefix match first
    sched2, model2 = make(max_running=1, max_wait_s=10.0)
    sched2.add(Request("warm", [*shared, 1], max_tokens=1))
    run(sched2, model2)
    cold2 = Request("cold", prompt(8, 20), max_tokens=1, arrival=100.0)
    sched2.add(cold2)
    sched2.add(Request("hit", [*shared, 2], max_tokens=1, arrival=101.0))
    assert sched2.schedule(now=111.0).requests == [cold2]  # waited > max_wait_s: goes first


def test_fcfs_keeps_arrival_order():
    sched, model = make(max_running=1, policy="fcfs")
    shared = prompt(7, 32)
    sched.add(Request("warm", [*shared, 1], max_tokens=1))
    run(sched, model)
    cold = Request("cold", prompt(8, 20), max_tokens=1)
    sched.add(cold)
    sched.add(Request("hit", [*shared, 2], max_tokens=1))
    assert sched.schedule().requests == [cold]


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_lower_priority_values_are_admitted_first(policy):
    sched, model = make(max_running=1, policy=policy, max_wait_s=10.0)
    shared = prompt(7, 32)
    sched.add(Request("warm", [*shared, 1], max_tokens=1))
    run(sched, model)
    batch_job = Request("batch", [*shared, 2], max_tokens=1, arrival=100.0, priority=5)  # cached, but low
    cold = Request("cold", prompt(8, 20), max_tokens=1, arrival=101.0)
    urgent = Request("urgent", prompt(9, 20), max_tokens=1, arrival=102.0, priority=-1)
    for r in (batch_job, cold, urgent):
        sched.add(r)
    admitted = []
    for _ in range(3):
        batch = sched.schedule(now=103.0)
        admitted += [r.rid for r in batch.requests]
        for r in sched.commit(batch, model.forward(batch)):
            if r.finish_reason is not None:
                sched.finish(r, r.finish_reason)
    assert admitted == ["urgent", "cold", "batch"]
    assert_no_leak(sched)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_the_age_bound_still_beats_priority(policy):
    sched, _ = make(max_running=1, max_wait_s=10.0, policy=policy)
    old_low = Request("old", prompt(8, 20), max_tokens=1, arrival=100.0, priority=9)
    sched.add(old_low)
    sched.add(Request("new", prompt(9, 20), max_tokens=1, arrival=109.0, priority=0))
    assert sched.schedule(now=111.0).requests == [old_low]  # waited > max_wait_s: nothing starves


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_an_urgent_request_behind_more_than_a_window_of_others_goes_first(policy):
    """The requests a step considers are the first in admission order (overdue, then by priority),
    not the queue's oldest: an urgent one behind more than lpm_window others waited for them."""
    sched, _ = make(max_running=1, max_waiting=100, max_wait_s=50.0, policy=policy, lpm_window=8)
    for i in range(20):
        sched.add(Request(f"low{i}", prompt(i, 8), max_tokens=1, arrival=100.0 + i, priority=10))
    urgent = Request("urgent", prompt(50, 8), max_tokens=1, arrival=121.0, priority=-5)
    sched.add(urgent)
    assert sched.schedule(now=122.0).requests == [urgent]
    overdue = Request("overdue", prompt(60, 8), max_tokens=1, arrival=60.0, priority=10)
    sched.add(overdue)  # the age bound still comes first, from anywhere in the queue
    sched.abort(urgent)
    sched.running.clear()
    assert sched.schedule(now=122.0).requests == [overdue]


def test_pages_run_out_the_lowest_priority_request_is_preempted_even_if_older():
    sched, model = make(
        num_pages=24, decode_reserve_tokens=0, chunked_prefill_tokens=64
    )  # 96 tokens: one fits
    low = Request("low", prompt(1, 20), max_tokens=40, priority=3)
    high = Request("high", prompt(2, 20), max_tokens=40, priority=0)
    sched.add(low)
    run_until = sched.schedule()  # low is admitted first (alone in the queue)
    sched.commit(run_until, model.forward(run_until))
    sched.add(high)
    run(sched, model)
    assert low.retractions >= 1 and high.retractions == 0  # the older but lower-priority one yields
    assert low.output_ids == reference(low.prompt_ids, 40) and high.output_ids == reference(
        high.prompt_ids, 40
    )
    assert_no_leak(sched)


def test_eos_finishes_and_waiting_queue_is_bounded():
    """The queue takes max_waiting requests beyond the free running slots (those go straight in)."""
    sched, model = make(max_waiting=2, max_running=2)
    p = prompt(9, 10)
    first = reference(p, 1)[0]
    r = Request("r", p, max_tokens=10, stop_token_ids=frozenset({first}))
    sched.add(r)
    for i, rid in enumerate("xyz"):  # with r: two for the free slots, two waiting
        sched.add(Request(rid, prompt(20 + i, 10), max_tokens=1))
    with pytest.raises(QueueFullError):
        sched.add(Request("w", prompt(30, 10), max_tokens=1))
    batch = sched.schedule()
    assert len(batch.requests) == 2  # r and x took the slots: y and z wait, and the queue is full
    with pytest.raises(QueueFullError):
        sched.add(Request("v", prompt(31, 10), max_tokens=1))
    for done in sched.commit(batch, model.forward(batch)):
        if done.finish_reason is not None:
            sched.finish(done, done.finish_reason)
    run(sched, model)
    assert r.finish_reason == "stop" and r.output_ids == [first]
    assert_no_leak(sched)


@pytest.mark.parametrize("host_pages", [0, 8, 64])
@pytest.mark.parametrize("seed", range(40))
def test_random_arrivals_aborts_and_pressure_keep_outputs_and_pages_right(seed, host_pages):
    rng = np.random.default_rng(seed)
    sched, model = make(
        num_pages=24,
        host_pages=host_pages,
        decode_reserve_tokens=int(rng.integers(0, 12)),
        chunked_prefill_tokens=int(rng.choice([4, 10, 64])),
        max_running=int(rng.integers(1, 6)),
    )
    pending: list[Request] = []
    for i in range(10):
        p = prefix_sharing_prompt(rng, 40)
        kw = {"priority": int(rng.integers(0, 3)), "full_prefill": bool(rng.random() < 0.3)}
        pending.append(Request(str(i), p, max_tokens=int(rng.integers(1, 40)), **kw))
    all_requests = list(pending)
    aborted: set[str] = set()
    while pending or sched.has_work():
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())
        batch = sched.schedule()
        if batch is None:
            continue
        for req in sched.commit(batch, model.forward(batch)):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
        abort_at_random(sched, rng, 0.03, aborted)
        assert_pages_accounted(sched, 24)
    assert_no_leak(sched)
    for req in all_requests:
        if req.rid not in aborted:
            assert req.output_ids == reference(req.prompt_ids, req.num_output)
            assert req.finish_reason == "length" and req.num_output == req.max_tokens
        if req.full_prefill and req.cached_tokens >= 0:  # NOTE: prompt logprobs need every position
            assert req.cached_tokens == 0


def test_a_prefix_moved_to_host_memory_is_a_hit_and_only_the_rest_is_computed():
    sched, model = make(num_pages=12, host_pages=32, decode_reserve_tokens=0)
    shared = prompt(1, 30)
    a = Request("a", [*shared, 1], max_tokens=2)
    sched.add(a)
    run(sched, model)
    for i in range(3):  # each fills most of the pool: a's pages move to host memory
        sched.add(Request(f"x{i}", prompt(10 + i, 40), max_tokens=2))
        run(sched, model)
    assert sched.cache.host_pages >= 7 and sched.cache.cached_prefix_len(np.asarray(shared)) == 28
    b = Request("b", [*shared, 2, 3], max_tokens=4)
    sched.add(b)
    steps = run(sched, model)
    assert b.cached_tokens == 28 and sched.cache.loaded_pages == 7
    assert steps[0].mode == "extend" and steps[0].starts == [28]  # 28 tokens copied, not computed
    assert b.output_ids == reference(b.prompt_ids, 4)
    assert_no_leak(sched)


def test_prefill_backlog_counts_prompt_tokens_admitted_and_waiting():
    sched, model = make(max_running=3)
    shared = prompt(7, 32)
    a, b, d = (Request(n, [*shared, t], max_tokens=4) for n, t in (("a", 1), ("b", 2), ("d", 3)))
    c = Request("c", prompt(8, 20), max_tokens=4)
    for r in (a, b, c, d):
        sched.add(r)
    assert sched.prefill_backlog == 3 * 33 + 20  # nothing cached when they came
    step = sched.schedule()
    assert step.requests == [a, c]  # b and d wait for a's pages of the shared prefix
    assert sched.prefill_backlog == 3 * 33 + 20  # admitted, nothing computed yet
    sched.commit(step, model.forward(step))
    assert sched.prefill_backlog == 2 * 33  # a and c decode; b and d still as estimated on arrival
    decode = sched.schedule()
    assert decode.mode == "decode"
    sched.commit(decode, model.forward(decode))
    step = sched.schedule()
    assert step.mode == "extend" and step.requests == [b]  # the batch is full after b
    assert sched.prefill_backlog == 1 + 1  # b's last token; d waits, re-estimated against the cache
    run(sched, model)
    assert sched.prefill_backlog == 0
    assert_no_leak(sched)


def test_decode_and_verify_steps_put_each_adapters_requests_side_by_side():
    """A stable order by adapter id, every per-request array (and drafts, inputs_from) following its
    request; extend steps keep their order, and steps without adapters are built as given."""
    from kernels.reference import lora_segments
    from worker.request import build_batch

    reqs = []
    for i, adapter in enumerate([2, 1, 0, 2, 1]):
        r = Request(str(i), [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=4, adapter=adapter)
        r.slots = np.arange(100 * i, 100 * i + 8)
        reqs.append(r)
    items = [(r, 2, 3) for r in reqs]
    step = build_batch("decode", items, [True, False, True, True, False], prefix_only=False,
                       inputs_from=np.array([4, -1, 0, 1, 2]))  # fmt: skip
    assert [r.rid for r in step.requests] == ["2", "1", "4", "0", "3"]
    assert step.sample == [True, False, False, True, True]
    assert step.inputs_from.tolist() == [0, -1, 2, 4, 1]
    assert step.out_slots.tolist() == [202, 102, 402, 2, 302]  # each request's own slot for position 2
    assert step.kv_indices.reshape(5, 3)[:, 0].tolist() == [200, 100, 400, 0, 300]
    assert lora_segments([r.adapter for r in step.requests], step.qo_indptr, 16)[1].tolist() == [
        0,
        1,
        2,
        -1,
        -1,
    ]
    verify = build_batch("verify", items, [True] * 5, prefix_only=True, drafts=[[i] * i for i in range(5)])
    assert [r.rid for r in verify.requests] == ["2", "1", "4", "0", "3"]
    assert verify.drafts == [[2, 2], [1], [4] * 4, [], [3] * 3]
    assert verify.input_ids[:3].tolist() == [23, 2, 2]  # request 2's last token, then its drafts
    extend = build_batch("extend", items, [True] * 5, prefix_only=True)
    assert [r.rid for r in extend.requests] == ["0", "1", "2", "3", "4"]
    for r in reqs:
        r.adapter = 0
    assert [r.rid for r in build_batch("decode", items, [True] * 5, prefix_only=False).requests] == list(
        "01234"
    )
