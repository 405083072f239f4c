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
        b.on_send()
        b.record_failure(now)
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(opens)]
    assert gaps == [2.0, 3.0, 3.0]


def test_success_resets_failure_count():
    b = CircuitBreaker(failure_threshold=2)
    b.record_failure(0.0)
    b.record_success()
    b.record_failure(0.0)
    assert b.state is BreakerState.CLOSED
