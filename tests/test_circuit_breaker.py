import itertools

from router.circuit_breaker import BreakerState, CircuitBreaker


def test_opens_after_consecutive_failures_and_probes_after_cooldown():
    b = CircuitBreaker(failure_threshold=3, open_seconds=5.0)
    b.record_failure(0.0)
    b.record_failure(0.0)
    assert b.allows(0.0)
    b.record_failure(1.0)
    assert b.state is BreakerState.OPEN and not b.allows(5.9)
    assert b.allows(6.0)  # half-open: one probe
    b.on_send()
    assert not b.allows(6.0)  # no second probe while the first is out
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows(6.0)


def test_failed_probe_doubles_cooldown_up_to_the_cap():
    b = CircuitBreaker(failure_threshold=1, open_seconds=1.0, max_open_seconds=3.0)
    b.record_failure(0.0)
    opens = []
    now = 0.0
    for _ in range(4):
        while not b.allows(now):
            now += 0.25
        opens.append(now)
        b.record_failure(now, b.on_send())
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(opens)]
    assert gaps == [2.0, 3.0, 3.0]


def test_success_resets_failure_count():
    b = CircuitBreaker(failure_threshold=2)
    b.record_failure(0.0)
    b.record_success()
    b.record_failure(0.0)
    assert b.state is BreakerState.CLOSED


def test_only_the_probe_in_flight_settles_the_half_open_state():
    """One probe at a time, whatever else ends meanwhile: a request sent before the breaker opened
    that fails late does not open it again, and a probe that is no longer the one in flight (its
    stream ran on past its answer) frees nothing when it ends."""
    b = CircuitBreaker(failure_threshold=1, open_seconds=2.0)
    assert b.allows(0.0) and b.on_send() == 0  # a long stream, sent while closed
    b.record_failure(0.0)  # another request's fault opens the breaker
    assert b.allows(2.0)
    first = b.on_send()
    assert first and not b.allows(2.0)
    b.record_failure(2.1)  # the old stream breaks: no word on the worker since it opened
    assert b.state is BreakerState.HALF_OPEN and not b.allows(2.1)
    b.record_failure(2.2, first)  # the probe's own failure: open again, for twice as long
    assert b.state is BreakerState.OPEN and not b.allows(6.1) and b.allows(6.2)
    second = b.on_send()
    assert second and second != first
    b.abandon_probe(first)  # the first probe's attempt ends: it is not the one in flight
    assert not b.allows(6.2)
    b.abandon_probe(second)  # the probe's client left: no verdict, the next request probes
    assert b.allows(6.2)
    third = b.on_send()
    b.record_success()
    b.abandon_probe(third)  # after its verdict, a no-op
    assert b.state is BreakerState.CLOSED and b.allows(6.3) and b.on_send() == 0


def test_a_probe_stream_that_breaks_after_its_head_doubles_the_cooldown_as_a_failed_probe():
    """A stream's head closes a half-open breaker (the worker answers); its faults in a row clear only
    when an answer is whole, so when that stream breaks the breaker opens again at once, for twice
    as long (it reopened for the first cool-down every time: no backing off)."""
    b = CircuitBreaker(failure_threshold=3, open_seconds=2.0, max_open_seconds=5.0)
    for _ in range(3):
        b.record_failure(0.0)
    now = 2.0
    for cooldown in (4.0, 5.0, 5.0):
        assert b.allows(now)
        probe = b.on_send()  # the probe, a stream
        b.answering(probe)  # its head: closed, traffic resumes
        assert b.state is BreakerState.CLOSED and b.allows(now)
        b.record_failure(now)  # it breaks off
        assert (
            b.state is BreakerState.OPEN and not b.allows(now + cooldown - 0.01) and b.allows(now + cooldown)
        )
        now += cooldown
    b.answering(b.on_send())
    b.record_success()  # a whole answer: every count cleared
    b.record_failure(now)
    assert b.state is BreakerState.CLOSED


def test_a_stream_head_of_a_request_sent_before_the_breaker_opened_leaves_it_open():
    """A slow stream sent while closed gets its head after the breaker opened (or while its probe is
    in flight): that says nothing of the worker since, as its failure would not. It closed the
    breaker before its cool-down ended, no probe sent."""
    b = CircuitBreaker(failure_threshold=3, open_seconds=2.0)
    old = b.on_send()  # sent while closed: 0
    for _ in range(3):
        b.record_failure(0.3)
    b.answering(old)
    assert b.state is BreakerState.OPEN and not b.allows(1.5)
    assert b.allows(2.3)
    probe = b.on_send()
    b.answering(old)  # half-open: still not the probe's
    assert b.state is BreakerState.HALF_OPEN and not b.allows(2.4)
    b.answering(probe)
    assert b.state is BreakerState.CLOSED and b.allows(2.5)
