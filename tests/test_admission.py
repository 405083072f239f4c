"""router.admission: a bounded number of requests in flight, FIFO waiting, 429 on a full queue,
503 after the wait bound, and no slot ever lost to a waiter that leaves (unit, asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionGate
from router.errors import RouterError


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # NOTE: lets scheduled callbacks run; no wall-clock wait


async def test_waiters_are_admitted_in_arrival_order_and_a_full_queue_is_429() -> None:
    gate = AdmissionGate(max_concurrent=2, max_queued=2, timeout_s=10)
    await gate.acquire()
    await gate.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await gate.acquire()
        order.append(name)

    a, b = asyncio.create_task(wait("a")), asyncio.create_task(wait("b"))
    await _settle()
    assert (gate.active, gate.queued) == (2, 2)
    with pytest.raises(RouterError) as full:
        await gate.acquire()
    assert full.value.status == 429 and full.value.code == "router_queue_full" and gate.rejected == 1
    assert full.value.retry_after == 1  # a full queue says when to come back (Retry-After)
    gate.release()
    await _settle()
    assert order == ["a"] and (gate.active, gate.queued) == (2, 1)  # the slot moved, not freed
    gate.release()
    await asyncio.gather(a, b)
    assert order == ["a", "b"] and gate.admitted_after_wait == 2
    gate.release()
    gate.release()
    assert (gate.active, gate.queued) == (0, 0)


async def test_a_wait_past_the_bound_is_503_and_leaves_the_queue() -> None:
    gate = AdmissionGate(max_concurrent=1, max_queued=4, timeout_s=0.05)
    await gate.acquire()
    with pytest.raises(RouterError) as late:
        await gate.acquire()
    assert late.value.status == 503 and late.value.code == "router_queue_timeout"
    assert (gate.active, gate.queued, gate.timed_out) == (1, 0, 1)
    gate.release()
    assert gate.active == 0


async def test_a_client_that_leaves_while_queued_gives_its_place_up() -> None:
    gate = AdmissionGate(max_concurrent=1, max_queued=4, timeout_s=10)
    await gate.acquire()
    gone = asyncio.create_task(gate.acquire())
    await _settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert gate.queued == 0
    gate.release()
    assert gate.active == 0
    await gate.acquire()  # straight in
    assert gate.active == 1


async def test_a_slot_handed_to_a_waiter_that_just_left_passes_to_the_next() -> None:
    gate = AdmissionGate(max_concurrent=1, max_queued=4, timeout_s=10)
    await gate.acquire()
    first, second = asyncio.create_task(gate.acquire()), asyncio.create_task(gate.acquire())
    await _settle()
    gate.release()  # the slot goes to ``first`` ...
    first.cancel()  # ... which leaves before it could take it
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 5)  # ``second`` gets it instead
    assert (gate.active, gate.queued) == (1, 0)
    gate.release()
    assert gate.active == 0


async def test_no_limit_admits_everything_at_once() -> None:
    gate = AdmissionGate(max_concurrent=0, max_queued=0, timeout_s=1)
    for _ in range(100):
        await gate.acquire()
    assert gate.active == 100 and gate.queued == 0
    await gate.acquire()
    assert gate.active == 101
    gate.release()
    assert gate.active == 100


async def test_lower_priority_values_are_admitted_first_and_equal_ones_in_arrival_order() -> None:
    gate = AdmissionGate(max_concurrent=1, max_queued=8, timeout_s=10)
    await gate.acquire()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await gate.acquire(priority)
        order.append(name)
        gate.release()

    tasks = []
    for name, priority in (("batch-1", 5), ("normal-1", 0), ("batch-2", 5), ("urgent", -1), ("normal-2", 0)):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await _settle()
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["urgent", "normal-1", "normal-2", "batch-1", "batch-2"]
    assert (gate.active, gate.queued) == (0, 0)
