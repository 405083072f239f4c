"""Per-worker circuit breaker: closed -> open after consecutive failures -> half-open probe.

Only worker faults count (connect errors, timeouts, 5xx); a client's own bad input never does.
Time is passed in (monotonic seconds) so behaviour is testable without sleeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3  # consecutive failures that open the breaker
    open_seconds: float = 5.0  # first cool-down; doubles on each failed probe up to max_open_seconds
    max_open_seconds: float = 60.0
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    _open_until: float = 0.0
    _cooldown: float = 0.0
    _probe: int = 0  # the number of the half-open probe in flight; 0: none
    _probes: int = 0  # probes sent so far (each is numbered, so only its own outcome settles it)

    def allows(self, now: float) -> bool:
        """May a request be sent now? In half-open state only one probe at a time passes."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now >= self._open_until:
            self.state = BreakerState.HALF_OPEN
            self._probe = 0
        return self.state is BreakerState.HALF_OPEN and not self._probe

    def on_send(self) -> int:
        """A request is being sent: the probe's number when it is the half-open probe, else 0.
        Give it back to ``record_failure`` and ``abandon_probe``."""
        if self.state is BreakerState.HALF_OPEN and not self._probe:
            self._probes += 1
            self._probe = self._probes
            return self._probe
        return 0

    def abandon_probe(self, probe: int) -> None:
        """Probe ``probe`` ended with no verdict (its client left, or it ran out of the request's own
        time): the next request may probe. Without this the breaker would stay half-open for good.
        A probe that is no longer the one in flight changes nothing."""
        if probe and probe == self._probe:
            self._probe = 0

    def answering(self, probe: int) -> None:
        """A stream's head came (``probe``: its number from ``on_send``): the probe's closes a half-open
        breaker, the worker answers; a head of a request sent before the breaker opened changes nothing
        (it says nothing of the worker since, as its failure would not). Faults in a row are cleared
        only once the answer is whole (``record_success``), so a worker that breaks off every stream
        after its head opens it again at its next fault, the cool-down doubled as for a failed probe
        (``_cooldown`` is cleared by a whole answer only)."""
        if self.state is BreakerState.HALF_OPEN and probe and probe == self._probe:
            self.state = BreakerState.CLOSED
            self._probe = 0

    def record_success(self) -> None:
        """Any request's answer: the worker answers, so the breaker closes."""
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._cooldown = 0.0
        self._probe = 0

    def record_failure(self, now: float, probe: int = 0) -> None:
        """A worker fault of a request (``probe``: its number from ``on_send``). Half-open, only the
        probe's own failure opens the breaker again: a request sent before it opened, failing late,
        says nothing of the worker since."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            if probe and probe == self._probe:
                self._cooldown = min(self.max_open_seconds, max(self.open_seconds, self._cooldown * 2))
                self._open(now)
        elif self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            # NOTE: a cool-down left means the breaker was closed by a stream's head alone since it opened
            self._cooldown = (
                min(self.max_open_seconds, self._cooldown * 2) if self._cooldown else self.open_seconds
            )
            self._open(now)

    def reset(self) -> None:
        """Forget history (a worker re-added, or a fresh start of the same address)."""
        self.record_success()

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._open_until = now + self._cooldown
        self._probe = 0
